"""The scheduler's records of ops and walks, and the pure parts of ending an op.

`OpRecord` is one op from admission to its final state; `WalkBatch` is the ops that share one
walk (a load step, or one backup). `result_of` builds the `OpResult` an op ends with;
`release_pages` gives back what admission reserved — each is called once per op, from
`Completion.finish` (completion.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from hicache.memory import HostTier
from hicache.scheduler.clock import Timer
from hicache.scheduler.moves import Selection
from hicache.scheduler.ops import GroupOutcome, GroupPages, OpKind, OpResult, OpState
from hicache.transfer import (
    NOOP_COUNTER,
    CancelToken,
    Fence,
    GroupMove,
    LayerDoneCounter,
    LayerListener,
    LoadCounter,
)


@dataclass(eq=False)
class OpRecord:
    op_id: int
    kind: OpKind
    selections: dict[str, tuple[GroupPages, Selection]]
    deadline: float
    finished: asyncio.Future[OpResult]
    submitted: asyncio.Future[None]
    moves: dict[str, GroupMove] = field(default_factory=dict)
    host_pages: dict[str, list[int]] = field(default_factory=dict)  # paired with moved pages
    pinned: dict[str, list[int]] = field(default_factory=dict)  # emptied by the one release
    allocated: dict[str, list[int]] = field(default_factory=dict)  # backup: freed unless acked
    nbytes: int = 0
    fence: Fence | None = None
    state: OpState = OpState.QUEUED
    counter: LayerDoneCounter = NOOP_COUNTER
    started_at: float = 0.0
    cancel_requested: bool = False
    expired: bool = False
    deadline_timer: Timer | None = None
    in_queue: bool = False
    attachment: int = 0  # whose device pools its moves copy (Scheduler's attachments)


@dataclass(eq=False)
class WalkBatch:
    kind: OpKind
    ops: list[OpRecord]
    token: CancelToken = field(default_factory=CancelToken)
    counter: LoadCounter | None = None
    nbytes: int = 0
    on_layer: LayerListener | None = None  # hears each landed `upto`, then a stop if any
    # whose device pools the batch moves (one call's ops: one attachment), fixed at creation
    attachment: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.ops:
            self.attachment = self.ops[0].attachment


@dataclass(frozen=True, slots=True)
class ShutdownReport:
    completed: tuple[int, ...]  # ops that were in flight and finished (any final state)
    cancelled: tuple[int, ...]  # ops still queued, cancelled unstarted


def result_of(op: OpRecord, state: OpState, failed: set[str], error: str, now: float) -> OpResult:
    """Outcomes per group: a load's groups that landed count as moved even when another
    group failed; a backup is acknowledged whole or not at all (the caller passes every
    group as failed unless DONE)."""
    outcomes = {}
    moved_bytes = 0
    for name, (pages, selection) in op.selections.items():
        skipped = tuple(pages.device_pages[i] for i in selection.skipped)
        chosen = tuple(pages.device_pages[i] for i in selection.positions)
        if name in failed:
            outcomes[name] = GroupOutcome(failed_device_pages=chosen, skipped_device_pages=skipped)
            continue
        outcomes[name] = GroupOutcome(
            moved_device_pages=chosen,
            host_pages=tuple(op.host_pages.get(name, ())),
            skipped_device_pages=skipped,
        )
        if name in op.moves:
            move = op.moves[name]
            moved_bytes += move.layer_bytes() * move.device.geometry.num_layers
    seconds = now - op.started_at if op.started_at else 0.0
    return OpResult(op.op_id, op.kind, state, outcomes, moved_bytes, seconds, error)


def release_pages(op: OpRecord, host_tier: HostTier, *, keep_allocation: bool) -> None:
    """Unpin every pinned page (once), and free a backup's pages unless acknowledged."""
    pinned, op.pinned = op.pinned, {}
    for name, pages in pinned.items():
        host_tier.pool(name).allocator.unpin(pages)
    allocated, op.allocated = op.allocated, {}
    if not keep_allocation:
        for name, pages in allocated.items():
            host_tier.pool(name).allocator.free(pages)
