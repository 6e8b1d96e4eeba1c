"""`Completion`: where the scheduler's ops end — `finish`, the one place, and `walk_done`,
a walk's report from the backend turned into each of its ops' ends.

Lifecycle: built once by the scheduler with what ending an op touches (the clock, the host
tier, the stats recorder, the attachments, the walk queue, the walk's shape) -> `set_state`
records every transition -> `walk_done(batch, errors)`, on the event loop once the backend
reported the walk, ends each op of it not ended yet (DONE, FAILED for a group at or after a
stop, CANCELLED / EXPIRED when asked) and then gives the walk's slots and bytes back; `finish`,
called for those and for every op ended otherwise (queued, expired, shut down, abandoned),
records the outcome, releases pins, frees the op's queue place and wakes its waiters.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.memory import HostTier
from hicache.scheduler.attachments import Attachments
from hicache.scheduler.clock import Clock
from hicache.scheduler.ops import OpKind, OpState
from hicache.scheduler.records import OpRecord, WalkBatch, release_pages, result_of
from hicache.scheduler.stats import StatsRecorder
from hicache.scheduler.walk_queue import WalkQueue
from hicache.transfer import NOOP_COUNTER, LayerFailure, StopKind, StoppedCounter


class Completion:
    def __init__(
        self,
        clock: Clock,
        host_tier: HostTier,
        recorder: StatsRecorder,
        attachments: Attachments,
        queue: WalkQueue,
        walk_slots: Sequence[tuple[tuple[str, int], ...]],
    ):
        self.clock = clock
        self.host_tier = host_tier
        self.recorder = recorder
        self.attachments = attachments
        self.queue = queue
        self.walk_slots = walk_slots  # per stage layer, its (group, local id) slots

    def walk_done(self, batch: WalkBatch, errors: dict[int, BaseException]) -> None:
        failed_groups = self._failed_groups(errors)
        first = next(iter(errors.values()), None)
        elapsed = self.clock.now()
        for op in batch.ops:
            if op.state.final:
                continue
            bad = failed_groups if -1 not in errors else set(op.moves)
            bad = bad & set(op.moves)
            if op.cancel_requested:
                state = OpState.EXPIRED if op.expired else OpState.CANCELLED
                self.finish(op, state, failed=set(op.moves), error=state.value)
            elif bad:
                self.finish(
                    op, OpState.FAILED, failed=bad, error=f"{type(first).__name__}: {first}"
                )
            else:
                self.finish(op, OpState.DONE)
                self.recorder.moved(op.kind, op.nbytes, elapsed - op.started_at)
        self.queue.walk_ended(batch)

    def _failed_groups(self, errors: dict[int, BaseException]) -> set[str]:
        return {group for pos in errors if pos >= 0 for group, _ in self.walk_slots[pos]}

    def finish(
        self, op: OpRecord, state: OpState, *, failed: set[str] | None = None, error: str = ""
    ) -> None:
        """The one place an op ends: outcomes recorded, pins released, waiters woken."""
        acknowledged = state is OpState.DONE
        if failed is None or (op.kind is OpKind.BACKUP and not acknowledged):
            failed = set() if acknowledged else set(op.moves)
        result = result_of(op, state, failed, error, self.clock.now())
        release_pages(op, self.host_tier, keep_allocation=acknowledged)
        if op.kind is OpKind.LOAD and not acknowledged and op.counter is NOOP_COUNTER:
            # ended before its walk was submitted: none of its layers will land
            kind = StopKind.CANCELLED if state is OpState.CANCELLED else StopKind.FAILED_WALK
            op.counter = StoppedCounter(LayerFailure(0, kind, error or state.value))
        self.queue.left(op)
        self.set_state(op, state)
        self.attachments.ended(op)  # its copies have ended: its attachment's pools may go
        if op.deadline_timer is not None:
            op.deadline_timer.cancel()
        # the walk (if any) enqueued its wait long ago: drop the event now, before the caller
        # hears, so an IPC-opened one is destroyed before the engine's original can be
        op.fence = None
        if not op.finished.done():
            op.finished.set_result(result)
        if not op.submitted.done():
            op.submitted.set_result(None)

    def set_state(self, op: OpRecord, state: OpState) -> None:
        self.recorder.transition(op.state, state)
        op.state = state
