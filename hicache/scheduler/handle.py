"""`OpHandle`: what a caller holds for one op.

`wait_layer(layer_id)` may be called from any thread (the engine's forward); it converts the
global id through the layer map (so misuse gets the guard's error), then waits on the
layer-done counter and records the stall. `await done()` gives the `OpResult`; `cancel()` is
safe from any thread. A load's handle is returned only after its whole walk was submitted.

When the load's walk stops at layer k (its copy failed, or the load was cancelled or ended
before its walk ran), `wait_layer(i)` raises `LayerLoadError` for every i >= k as soon as the
stop is known — naming the load, the layer and the cause — instead of returning for pages
that never landed; layers before k return as usual. A layer where this op had nothing to copy
(no cache of a group it moves; in a merged walk the stop may be another op's) returns: there
is nothing of this load to read there. `done()` reports the load's end once, as before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from hicache.errors import LayerLoadError
from hicache.scheduler.ops import OpKind, OpResult, OpState

if TYPE_CHECKING:
    from hicache.scheduler.records import OpRecord
    from hicache.scheduler.scheduler import Scheduler


class OpHandle:
    def __init__(self, scheduler: Scheduler, op: OpRecord):
        self._scheduler = scheduler
        self._op = op

    @property
    def op_id(self) -> int:
        return self._op.op_id

    @property
    def kind(self) -> OpKind:
        return self._op.kind

    @property
    def state(self) -> OpState:
        return self._op.state

    @property
    def result(self) -> OpResult | None:
        fut = self._op.finished
        return fut.result() if fut.done() else None

    def wait_layer(self, layer_id: int) -> None:
        layer_map = self._scheduler.layer_map
        index = layer_map.stage_index(layer_id)
        started = time.perf_counter()
        stopped = self._op.counter.wait_layer(index)
        self._scheduler.recorder.waited(index, time.perf_counter() - started)
        if stopped is not None:
            moves = self._op.moves
            if any(slot.group.name in moves for slot in layer_map.slots(layer_id)):
                stop_layer = layer_map.stage_layer_ids[stopped.position]
                raise LayerLoadError(self.op_id, layer_id, stopped.cause(layer_id, stop_layer))

    def add_done_callback(self, callback: Callable[[OpResult], None]) -> None:
        """Call `callback(result)` on the event loop when the op ends (at once if it has)."""
        self._op.finished.add_done_callback(lambda future: callback(future.result()))

    async def done(self) -> OpResult:
        return await asyncio.shield(self._op.finished)

    def cancel(self) -> None:
        loop = self._scheduler.loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._scheduler.cancel_op(self._op)
        else:
            loop.call_soon_threadsafe(self._scheduler.cancel_op, self._op)

    def __repr__(self) -> str:
        return f"OpHandle({self.kind.value} #{self.op_id}, {self.state.value})"
