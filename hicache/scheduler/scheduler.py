"""`Scheduler`: the asyncio core that turns ops into layer walks.

Lifecycle:
    async with Scheduler(...).running() as sched:      # one TaskGroup owns every task
        handles = await sched.load_step([pages_a, pages_b])   # merged into one walk
        handle.wait_layer(i)  (engine thread)  /  await handle.done()
        await sched.backup(pages)                      # ordered after the producer's kernels
    # leaving: queued ops are cancelled, in-flight walks finish, pins are released

Admission (in the caller's task) validates the request, selects the pages each group moves
(moves.py), pins host pages (loads) or allocates them (backups) — reserve. The dispatcher
takes loads before backups, waits for byte budget and a counter slot (backpressure;
walk_queue.py), walks the stage's layers through the layer map and submits the whole walk to
the copy backend at once — submit. The backend reports the walk from its thread;
`Completion.walk_done` records outcomes and releases pins and budget — complete/abort, in
exactly one place (`Completion.finish`, completion.py).

A caller cancelled (or failing) at an await of `load`, `load_step` or `backup` — waiting for
queue space, or for its walk to be submitted — takes its ops with it (`_abandon`): an op not
yet queued or still queued ends CANCELLED at once, its pins and pages released; one whose walk
was submitted is cancelled like any running op and ends, its pins released, when the backend
reports the walk. Nothing is left that no one holds a handle to.

A walk that stops at a layer (backend.py: a failed copy stops it, later layers are skipped)
fails every op with a group at or after the stop; the consumers of its layers from the stop
on hear it through the counter while the walk is still ending (`OpHandle.wait_layer` raises),
and `walk_done` still ends each op once, after the backend reported, so pins outlive every
copy. A load that ends before its walk is submitted gets a `StoppedCounter`, so its layers
raise too rather than return for pages nothing copied.

Attachments: the device pools ops copy to and from are registered by attachment id — the
constructor's under `DEFAULT_ATTACHMENT`, one set per engine in the sidecar
(`attach_device_pools(pools, attachment=session_id)`) — and every op names the attachment
whose pools it moves (`attachment=`), while the host tier, the budget and the walks are
shared. `detach_device_pools(a)` drops one attachment once none of its ops is queued or in
flight; `end_attachment(a)` cancels its ops, awaits their end (their pins go with them) and
then drops it, leaving every other attachment's ops untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from typing import Any

from hicache.errors import HicacheError
from hicache.memory import DevicePool, HostTier
from hicache.model import LayerMap
from hicache.scheduler.admission import reserve, select_pages
from hicache.scheduler.attachments import DEFAULT_ATTACHMENT, Attachments
from hicache.scheduler.clock import Clock, MonotonicClock
from hicache.scheduler.completion import Completion
from hicache.scheduler.handle import OpHandle
from hicache.scheduler.moves import MovePolicy, OpRequestError
from hicache.scheduler.ops import GroupPages, OpKind, OpState
from hicache.scheduler.records import OpRecord, ShutdownReport, WalkBatch, release_pages
from hicache.scheduler.stats import SchedulerStats, StatsRecorder
from hicache.scheduler.walk_queue import WalkQueue
from hicache.transfer import NOOP_COUNTER, CopyBackend, Direction, Fence
from hicache.transfer.backend import LayerListener, LayerPart


class SchedulerClosedError(HicacheError, RuntimeError):
    """The scheduler is not running (not started, or shutting down)."""


class Scheduler:
    def __init__(
        self,
        layer_map: LayerMap,
        backend: CopyBackend,
        device_pools: Mapping[str, DevicePool],
        host_tier: HostTier,
        *,
        page_size_tokens: int,
        queue_depth: int,
        inflight_bytes: int,
        op_timeout_s: float,
        move_policy: MovePolicy,
        counter_ring_size: int,
        backup_walks_in_flight: int = 1,
        clock: Clock | None = None,
    ):
        self.layer_map = layer_map
        self.backend = backend
        self.host_tier = host_tier
        self.page_size_tokens = page_size_tokens
        self.queue_depth = queue_depth
        self.op_timeout_s = op_timeout_s
        self.move_policy: MovePolicy = move_policy
        self.clock: Clock = clock or MonotonicClock()
        self.recorder = StatsRecorder(len(layer_map.stage_layer_ids))
        self.inflight_bytes = inflight_bytes
        self.counter_ring_size = counter_ring_size
        # queued walks, walks in flight per kind (walk slots), bytes in flight (the budget)
        self._queue = WalkQueue(
            queue_depth, inflight_bytes, counter_ring_size, backup_walks_in_flight
        )
        self._ids = itertools.count(1)
        self._tg: asyncio.TaskGroup | None = None
        self._closing = False
        self.loop: asyncio.AbstractEventLoop
        # the walk's shape, computed once: per stage layer, its (group, local id) slots
        self._walk_slots = [
            tuple((s.group.name, s.local_id) for s in layer_map.slots(layer_id))
            for layer_id in layer_map.stage_layer_ids
        ]
        missing = {g.name for g in layer_map.groups} - set(device_pools)
        if missing or set(device_pools) - set(host_tier.pools):
            raise OpRequestError(
                f"device pools {sorted(device_pools)} and host pools "
                f"{sorted(host_tier.pools)} must cover the stage's groups "
                f"{sorted(g.name for g in layer_map.groups)}"
            )
        self._attachments = Attachments({n: pool.geometry for n, pool in device_pools.items()})
        self._attachments.add(DEFAULT_ATTACHMENT, device_pools)
        self._completion = Completion(
            self.clock, host_tier, self.recorder, self._attachments, self._queue, self._walk_slots
        )

    # ---- lifecycle ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Scheduler]:
        self.loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            dispatcher = tg.create_task(self._dispatch(), name="hicache-dispatch")
            try:
                yield self
            finally:
                self.last_shutdown = await self.shutdown()
                dispatcher.cancel()
        self._tg = None

    async def shutdown(self) -> ShutdownReport:
        """Stop accepting ops, cancel the queued ones, let in-flight walks finish."""
        self._closing = True
        cancelled = []
        for batch in self._queue.drain():
            for op in batch.ops:
                if op.state is OpState.QUEUED:
                    self._completion.finish(op, OpState.CANCELLED, error="scheduler shut down")
                    cancelled.append(op.op_id)
        self._queue.open_space()
        self._queue.set_idle()
        running = [op.op_id for batch in self._queue.in_flight for op in batch.ops]
        await self._queue.wait_idle()
        return ShutdownReport(tuple(running), tuple(cancelled))

    async def idle(self) -> None:
        """Until no op is queued or in flight (every walk ended, its pins released)."""
        await self._queue.wait_idle()

    # ---- submission -----------------------------------------------------------------------

    def load(
        self,
        groups: Mapping[str, GroupPages],
        *,
        deadline_s: float | None = None,
        on_layer: LayerListener | None = None,
        fence: Fence | None = None,
        attachment: int = DEFAULT_ATTACHMENT,
    ) -> Coroutine[Any, Any, OpHandle]:
        """One load: `load_step` of one request (its fence, too, taken when this is called)."""
        return self._first(
            self.load_step(
                [groups],
                deadline_s=deadline_s,
                on_layer=on_layer,
                fence=fence,
                attachment=attachment,
            )
        )

    @staticmethod
    async def _first(handles: Coroutine[Any, Any, list[OpHandle]]) -> OpHandle:
        return (await handles)[0]

    def load_step(
        self,
        requests: Sequence[Mapping[str, GroupPages]],
        *,
        deadline_s: float | None = None,
        on_layer: LayerListener | None = None,
        fence: Fence | None = None,
        attachment: int = DEFAULT_ATTACHMENT,
    ) -> Coroutine[Any, Any, list[OpHandle]]:
        """Loads of one engine step, merged into one walk. Returns once the walk is submitted
        (or the ops ended unsubmitted), so `wait_layer` never waits on unsubmitted work.
        `on_layer(upto, None)` hears, from the backend's thread, each stage-local layer count
        that has landed, and `on_layer(k, failure)` the walk's stop at layer k if it stops
        (the sidecar's cross-process counter; `LayerListener`). A caller cancelled while this
        waits (for queue space or a walk slot) cancels its ops: nothing stays pinned, and no
        walk writes its device pages after it (one already submitted is cancelled and ends
        when the backend reports it). The device pages are `attachment`'s pools'.

        Ordering (CUDA): the copies run after `fence`, the point in the engine's work after
        which the device pages are the load's to write (its kernels that still read them from
        an earlier use, vLLM's zeroing of newly allocated blocks); without one, after the work
        queued so far on the calling thread's current stream (`producer_fence`), taken when
        this is called — a plain method returning the coroutine, so an engine thread that
        hands it to the loop (`run_coroutine_threadsafe`) fences its own stream, not the
        loop thread's. A sidecar passes the engine's IPC event, or `NO_FENCE`. A merged walk
        waits for every op's."""
        if fence is None:
            fence = self.backend.producer_fence()  # now, on the caller's thread
        return self._load_step(requests, deadline_s, on_layer, fence, attachment)

    async def _load_step(
        self,
        requests: Sequence[Mapping[str, GroupPages]],
        deadline_s: float | None,
        on_layer: LayerListener | None,
        fence: Fence | None,
        attachment: int,
    ) -> list[OpHandle]:
        ops = self._admit_all(OpKind.LOAD, requests, deadline_s, attachment)
        for op in ops:
            op.fence = fence
        try:
            await self._enqueue(WalkBatch(OpKind.LOAD, ops, on_layer=on_layer))
            # Fast path: start whatever is ready now, in this task, rather than a loop
            # iteration later in the dispatcher (same rules; the loop runs one at a time).
            while (ready := self._queue.next_ready()) is not None:
                self._launch(ready)
            if not all(op.submitted.done() for op in ops):
                await asyncio.gather(*(asyncio.shield(op.submitted) for op in ops))
        except BaseException as exc:  # cancelled (or failed) before the caller got its handles
            self._abandon(ops, exc)
            raise
        return [OpHandle(self, op) for op in ops]

    def backup(
        self,
        groups: Mapping[str, GroupPages],
        *,
        deadline_s: float | None = None,
        fence: Fence | None = None,
        attachment: int = DEFAULT_ATTACHMENT,
    ) -> Coroutine[Any, Any, OpHandle]:
        """Copy device pages to host pages — the ones the caller reserved in `host_pages`, or
        newly allocated ones — ordered after the producer's work: after `fence` (made with
        `backend.producer_fence(stream)` on the thread, and after the kernels, that wrote the
        KV; `NO_FENCE` when the producer synchronised; an imported IPC event for another
        process), or, without one, after the work queued so far on the calling thread's
        current stream when this is called (as `load_step`'s, not when the coroutine first
        runs) — right only when that is where the pages were written. The result's
        outcomes name the host pages (owned by the caller once DONE). A caller cancelled
        while this waits for queue space cancels the op: its pages are freed. The device
        pages are `attachment`'s pools'."""
        if fence is None:
            fence = self.backend.producer_fence()  # now, on the caller's thread
        return self._backup(groups, deadline_s, fence, attachment)

    async def _backup(
        self,
        groups: Mapping[str, GroupPages],
        deadline_s: float | None,
        fence: Fence | None,
        attachment: int,
    ) -> OpHandle:
        ops = self._admit_all(OpKind.BACKUP, [groups], deadline_s, attachment)
        ops[0].fence = fence
        try:
            await self._enqueue(WalkBatch(OpKind.BACKUP, ops))
        except BaseException as exc:  # cancelled (or failed) waiting for queue space
            self._abandon(ops, exc)
            raise
        return OpHandle(self, ops[0])

    @property
    def device_pools(self) -> dict[str, DevicePool]:
        """The default attachment's pools (an embedded engine's; none once detached)."""
        return self._attachments.get(DEFAULT_ATTACHMENT)

    @property
    def attachments(self) -> tuple[int, ...]:
        """The attachment ids whose device pools are registered now."""
        return self._attachments.ids

    def live_ops(self, attachment: int) -> int:
        """How many of `attachment`'s ops are admitted and not ended (queued or in flight)."""
        return len(self._attachments.live(attachment))

    def attach_device_pools(
        self, device_pools: Mapping[str, DevicePool], *, attachment: int = DEFAULT_ATTACHMENT
    ) -> None:
        """Register an engine's device pools under `attachment` (the sidecar: one per engine
        session of a namespace; its ops name it). Every group of the stage, each with the
        stage's geometry. Replacing an attachment's pools is refused while one of its ops is
        queued or in flight (a walk never straddles two sets of memory); other attachments'
        ops go on meanwhile."""
        self._attachments.add(attachment, device_pools)

    def detach_device_pools(self, attachment: int = DEFAULT_ATTACHMENT) -> None:
        """Forget `attachment`'s device pools (its engine went away); its later ops are
        refused. Only once none of its ops is queued or in flight (`end_attachment` cancels
        and awaits them first); other attachments are untouched."""
        self._attachments.remove(attachment)

    async def end_attachment(self, attachment: int, reason: str = "its engine detached") -> int:
        """Cancel `attachment`'s ops (queued ones end now, running ones when their walk is
        reported), await their end — their pins go with them — and drop its device pools.
        Returns how many ops were cancelled."""
        cancelled = 0
        while live := self._attachments.live(attachment):  # none admitted meanwhile is left
            for op in live:
                self.cancel_op(op, reason)
            cancelled += len(live)
            await asyncio.gather(*(asyncio.shield(op.finished) for op in live))
        self._queue.set_idle()
        self._attachments.remove(attachment)
        return cancelled

    def cancel_op(self, op: OpRecord, reason: str = "cancelled before it started") -> None:
        """A queued op (or one admitted, not yet queued) ends now, CANCELLED with `reason`;
        a running one asks its walk to stop and ends when the backend reports the walk."""
        if op.state is OpState.QUEUED:
            self._completion.finish(op, OpState.CANCELLED, error=reason)
        elif op.state is OpState.RUNNING:
            op.cancel_requested = True
            self._maybe_cancel_walk(op)

    def _abandon(self, ops: Sequence[OpRecord], cause: BaseException) -> None:
        """The caller left before it got its handles (cancelled at an await, or an error):
        no one can wait for, use or cancel these ops, so cancel them all now."""
        why = "cancelled" if isinstance(cause, asyncio.CancelledError) else type(cause).__name__
        for op in ops:
            self.cancel_op(op, f"its caller left ({why}) before it got the op's handle")
        self._queue.set_idle()

    def stats(self) -> SchedulerStats:
        return self.recorder.snapshot(
            queued_loads=self._queue.queued(OpKind.LOAD),
            queued_backups=self._queue.queued(OpKind.BACKUP),
            in_flight_bytes=self._queue.in_flight_bytes,
            walks=len(self._queue.in_flight),
        )

    # ---- admission: validate, select, reserve ---------------------------------------------

    def _admit_all(
        self,
        kind: OpKind,
        requests: Sequence[Mapping[str, GroupPages]],
        deadline_s: float | None,
        attachment: int,
    ) -> list[OpRecord]:
        if self._tg is None or self._closing:
            raise SchedulerClosedError(
                "the scheduler is not running; use `async with scheduler.running():`"
            )
        device_pools = self._attachments.pools(attachment)
        ops: list[OpRecord] = []
        try:
            for request in requests:
                ops.append(self._admit(kind, request, deadline_s, device_pools))
        except BaseException:
            for op in ops:  # all or nothing: undo the ops admitted before the bad one
                release_pages(op, self.host_tier, keep_allocation=False)
            raise
        self._attachments.admitted(attachment, ops)
        return ops

    def _admit(
        self,
        kind: OpKind,
        request: Mapping[str, GroupPages],
        deadline_s: float | None,
        device_pools: Mapping[str, DevicePool],
    ) -> OpRecord:
        timeout = self.op_timeout_s if deadline_s is None else deadline_s
        if timeout <= 0:
            raise OpRequestError(f"deadline_s {timeout!r} must be > 0")
        selections = select_pages(
            kind, request, self.layer_map, self.page_size_tokens, self.move_policy
        )
        loop = asyncio.get_running_loop()
        op = OpRecord(
            next(self._ids),
            kind,
            selections,
            self.clock.now() + timeout,
            loop.create_future(),
            loop.create_future(),
        )
        try:
            reserve(op, self.backend, device_pools, self.host_tier)
        except BaseException:
            release_pages(op, self.host_tier, keep_allocation=False)
            raise
        self.recorder.transition(None, OpState.QUEUED)
        return op

    async def _enqueue(self, batch: WalkBatch) -> None:
        while self._queue.full and not self._closing:
            await self._queue.wait_for_space()  # backpressure: the queue is bounded
        if self._closing:
            for op in batch.ops:
                self._completion.finish(op, OpState.CANCELLED, error="scheduler shut down")
            return
        # ops cancelled while they waited for space (`end_attachment`) ended already
        batch.ops = [op for op in batch.ops if not op.state.final]
        if not batch.ops:
            return
        for op in batch.ops:
            op.deadline_timer = self.clock.call_later(
                op.deadline - self.clock.now(), functools.partial(self._deadline_passed, op)
            )
        self._queue.append(batch)

    # ---- dispatch: order, budget, walk, submit ----------------------------------------------

    async def _dispatch(self) -> None:
        while True:
            batch = self._queue.next_ready()
            if batch is None:
                await self._queue.wait_for_change()
                continue
            self._launch(batch)

    def _launch(self, batch: WalkBatch) -> None:
        direction = Direction.LOAD if batch.kind is OpKind.LOAD else Direction.BACKUP
        ops = batch.ops
        layers: list[list[LayerPart]] = [
            [
                (move, local_id)
                for group, local_id in slots
                for op in ops
                if (move := op.moves.get(group)) is not None
            ]
            for slots in self._walk_slots
        ]
        now = self.clock.now()
        for op in batch.ops:
            self._completion.set_state(op, OpState.RUNNING)
            op.started_at = now
        if len(batch.ops) > 1:
            self.recorder.merged_walks += 1
        # a backup walk is one op (never merged); a merged load walk waits for every op's
        fence = self.backend.join_fences([op.fence for op in batch.ops])
        loop = self.loop

        def done(errors: dict[int, BaseException]) -> None:  # backend thread
            if loop.is_closed():
                return  # the loop is gone (a process exiting): no one is left to hear it
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(self._completion.walk_done, batch, errors)

        if batch.kind is OpKind.LOAD:
            batch.counter = self._queue.acquire_counter(batch.ops[0].op_id, len(layers))
        try:
            signals = self.backend.submit_walk(
                direction, layers, done, fence, batch.token, batch.on_layer
            )
        except Exception as exc:
            self._completion.walk_done(batch, {-1: exc})
            return
        if batch.counter is not None:
            batch.counter.submitted(signals)
        for op in batch.ops:
            op.counter = batch.counter or NOOP_COUNTER
            if not op.submitted.done():
                op.submitted.set_result(None)

    # ---- deadlines and cancellation ---------------------------------------------------------

    def _deadline_passed(self, op: OpRecord) -> None:
        if op.state is OpState.QUEUED:
            self._completion.finish(op, OpState.EXPIRED, error="deadline passed while queued")
        elif op.state is OpState.RUNNING:
            op.expired = True
            op.cancel_requested = True
            self._maybe_cancel_walk(op)

    def _maybe_cancel_walk(self, op: OpRecord) -> None:
        for batch in self._queue.in_flight:
            if op in batch.ops and all(o.cancel_requested for o in batch.ops):
                batch.token.cancel()
