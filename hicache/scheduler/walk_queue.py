"""`WalkQueue`: the scheduler's queued walks, its walks in flight, and which one starts next.

Lifecycle of a batch: `append` (queued, counted against the queue depth) -> `next_ready`
takes it off the queue once it can start (loads first; a walk slot of its kind and the byte
budget) -> in flight until `walk_ended` (its counter slot, walk slot and bytes go back). An
op that ends while still queued leaves through `left` (from the scheduler's one `finish`);
at shutdown `drain` hands over every queued batch. Its events: the dispatcher waits for a
change (`wait_for_change`: a new op, a freed slot or budget), a caller for queue space
(`wait_for_space`), shutdown for idle (`wait_idle`: nothing queued or in flight).
Bookkeeping only: the scheduler launches what `next_ready` returns, nothing here submits.

Fairness across engines: each kind's queue is one FIFO per attachment (an engine's pools),
served round-robin — the attachment whose batch starts goes to the back of the turn. The
bound: a batch at the head of its attachment's queue starts after at most one walk of its
kind per other attachment with batches of that kind queued (N - 1 walks for N such
attachments; in bytes, at most N - 1 of their batches), besides the walks already in flight
when it reached the head. An engine's i-th queued batch therefore waits at most i rounds,
however deep another engine's backlog is. Before, one FIFO per kind put a quiet engine's
load behind every load a busy one had queued.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from hicache.scheduler.budget import ByteBudget
from hicache.scheduler.ops import OpKind, OpState
from hicache.scheduler.records import OpRecord, WalkBatch
from hicache.transfer import CounterRing, LoadCounter


@dataclass
class _FairQueue:
    """One kind's queued batches: a FIFO per attachment, served in turn."""

    by_attachment: dict[int, deque[WalkBatch]] = field(default_factory=dict)
    turns: deque[int] = field(default_factory=deque)  # attachments with batches, next first

    def append(self, batch: WalkBatch) -> None:
        queue = self.by_attachment.get(batch.attachment)
        if queue is None:
            queue = self.by_attachment[batch.attachment] = deque()
            self.turns.append(batch.attachment)
        queue.append(batch)

    def head(self) -> WalkBatch | None:
        """The batch whose turn it is, dropping batches whose ops all ended while queued
        (cancelled or expired) and attachments left with none."""
        while self.turns:
            queue = self.by_attachment[self.turns[0]]
            while queue and all(op.state.final for op in queue[0].ops):
                queue.popleft()
            if queue:
                return queue[0]
            del self.by_attachment[self.turns.popleft()]
        return None

    def pop_head(self) -> WalkBatch:
        """Take the head batch; its attachment goes to the back of the turn."""
        attachment = self.turns.popleft()
        queue = self.by_attachment[attachment]
        batch = queue.popleft()
        if queue:
            self.turns.append(attachment)
        else:
            del self.by_attachment[attachment]
        return batch

    def batches(self) -> Iterator[WalkBatch]:
        for queue in self.by_attachment.values():
            yield from queue

    def drain(self) -> Iterator[WalkBatch]:
        while self.turns:
            queue = self.by_attachment.pop(self.turns.popleft())
            while queue:
                yield queue.popleft()

    def __bool__(self) -> bool:
        return bool(self.turns)


class WalkQueue:
    def __init__(
        self,
        depth: int,
        inflight_bytes: int,
        counter_ring_size: int,
        backup_walks_in_flight: int,
    ):
        self.depth = depth
        self._budget = ByteBudget(inflight_bytes)
        self._ring = CounterRing(counter_ring_size)
        # Walks handed to the backend, per kind. Bounded so the backend's own FIFO never
        # becomes the real queue: a load must not wait behind every backup already handed over.
        self._walk_limit = {OpKind.LOAD: counter_ring_size, OpKind.BACKUP: backup_walks_in_flight}
        self._walks = {OpKind.LOAD: 0, OpKind.BACKUP: 0}
        self._queues: dict[OpKind, _FairQueue] = {
            OpKind.LOAD: _FairQueue(),
            OpKind.BACKUP: _FairQueue(),
        }
        self._queued_ops = 0
        self._wake = asyncio.Event()  # something changed: a new op, a freed slot or budget
        self._space = asyncio.Event()
        self._space.set()
        self.in_flight: set[WalkBatch] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def full(self) -> bool:
        return self._queued_ops >= self.depth

    @property
    def in_flight_bytes(self) -> int:
        return self._budget.in_flight_bytes

    def queued(self, kind: OpKind) -> int:
        """How many of `kind`'s queued ops have not ended."""
        return sum(op.state is OpState.QUEUED for b in self._queues[kind].batches() for op in b.ops)

    async def wait_for_space(self) -> None:
        self._space.clear()
        await self._space.wait()

    def open_space(self) -> None:
        """Wake every caller waiting for queue space (shutdown: they find it closing)."""
        self._space.set()

    async def wait_for_change(self) -> None:
        self._wake.clear()
        await self._wake.wait()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def set_idle(self) -> None:
        if not self.in_flight and self._queued_ops == 0:
            self._idle.set()

    def append(self, batch: WalkBatch) -> None:
        for op in batch.ops:
            op.in_queue = True
        self._queues[batch.kind].append(batch)
        self._queued_ops += len(batch.ops)
        self._idle.clear()
        self._wake.set()

    def drain(self) -> Iterator[WalkBatch]:
        """Every queued batch, each taken off its queue as it is handed over."""
        for queue in self._queues.values():
            yield from queue.drain()

    def next_ready(self) -> WalkBatch | None:
        """The next batch that can start now: loads first, each kind's attachments in turn
        (module docstring). A batch that lacks a walk slot or byte budget stays queued;
        backups may pass a load only when that load waits for a counter slot (they compete
        for nothing else it needs)."""
        for kind in (OpKind.LOAD, OpKind.BACKUP):
            queue = self._queues[kind]
            batch = queue.head()
            if batch is None:
                continue
            nbytes = sum(op.nbytes for op in batch.ops if op.state is OpState.QUEUED)
            if not self._budget.fits(nbytes):
                return None
            if self._walks[kind] >= self._walk_limit[kind]:
                continue
            queue.pop_head()
            batch.ops = [op for op in batch.ops if op.state is OpState.QUEUED]
            for op in batch.ops:
                op.in_queue = False
            self._queued_ops -= len(batch.ops)
            self._space.set()
            batch.nbytes = nbytes
            self._budget.take(nbytes)
            self._walks[kind] += 1
            self.in_flight.add(batch)
            return batch
        return None

    def acquire_counter(self, op_id: int, layers: int) -> LoadCounter:
        """A load walk's layer-done counter (a ring slot: loads in flight are bounded by it)."""
        return self._ring.acquire(op_id, layers)

    def left(self, op: OpRecord) -> None:
        """`op` ended; if it was still queued, its place is free."""
        if op.in_queue:
            op.in_queue = False
            self._queued_ops -= 1
            self._space.set()
            self._wake.set()

    def walk_ended(self, batch: WalkBatch) -> None:
        """The backend reported `batch`'s walk: its counter slot, walk slot and bytes go back."""
        if batch.counter is not None:
            self._ring.release(batch.counter)
            batch.counter = None
        self._walks[batch.kind] -= 1
        self._budget.release(batch.nbytes)
        self.in_flight.discard(batch)
        self._wake.set()
        self.set_idle()
