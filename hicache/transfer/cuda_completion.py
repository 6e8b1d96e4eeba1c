"""Completion of CUDA walks: one thread per copy stream, waiting its walks' events in order.

Lifecycle: `WalkCompletion(name)` starts its daemon thread; `put(walk)` queues a walk whose
events are recorded on the stream this completion serves; the thread waits each landed
layer's event (`synchronize()`: blocking-sync events, so it sleeps), tells the listener of
each layer as it lands (`on_layer(k + 1, None)`), then `last` (everything enqueued, a
stopped layer's partial copies included), then the stop (`on_layer(k, failure)`) and
`done(errors)`; `stop()` queues the end after every walk already queued; `join(timeout)`.
A walk's callbacks that raise are logged; later walks go on. An event that reports a CUDA
error stops its walk there (`LayerFailure` at that position, the whole walk failed).

One per stream, never one for both: a stream runs its walks in order, so waiting them in
the order they were queued costs nothing, while a load must never wait behind a backup on
the other stream — a multi-GB backup gated on an engine's fence (or a fence that never
fires) would hold every later load's per-layer signals, the engine's only view of progress.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from hicache.transfer.backend import Direction, LayerFailure, LayerListener, WalkDone
from hicache.transfer.cuda_events import CudaWalkSignals

log = logging.getLogger("hicache.transfer")


@dataclass(frozen=True, slots=True)
class PendingWalk:
    """What the completion thread waits for: each landed layer's event, then `last` (after
    everything enqueued, a stopped layer's partial copies included), then `done`."""

    signals: CudaWalkSignals
    last: Any  # an event, or None when nothing was enqueued
    errors: dict[int, BaseException]
    done: WalkDone
    on_layer: LayerListener | None


class WalkCompletion:
    """The completion thread of one copy stream (`name`: the thread's suffix)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[PendingWalk | None] = queue.SimpleQueue()  # None: stop
        self.thread = threading.Thread(
            target=self._run, name=f"hicache-cuda-complete-{name}", daemon=True
        )
        self.thread.start()

    def put(self, walk: PendingWalk) -> None:
        self._queue.put(walk)

    def stop(self) -> None:
        """End the thread once every walk queued before this has completed."""
        self._queue.put(None)

    def join(self, timeout_s: float | None) -> bool:
        """Join the thread (at most `timeout_s`); True once it ended."""
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout_s)
        return not self.thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            complete(item)
            del item  # nothing of the walk (pools, mapped memory, listener) outlives it here


def per_stream() -> dict[Direction, WalkCompletion]:
    """A backend's completion threads: one per direction, as it has one stream per direction."""
    return {direction: WalkCompletion(direction.value) for direction in Direction}


def complete(item: PendingWalk) -> None:
    """Wait one walk's events in order and tell its listener and `done` (never raises)."""
    signals, errors, on_layer = item.signals, item.errors, item.on_layer
    position = 0
    try:
        # events record in order: `last` covers the walk; with a listener, each landed
        # layer's event is waited in turn so it hears of every layer as it lands
        if on_layer is not None:
            for position, event in enumerate(signals.events):
                if event is not None:
                    event.synchronize()
                on_layer(position + 1, None)
            position = len(signals.events)
        if item.last is not None:
            item.last.synchronize()
    except Exception as exc:  # the walk failed as a whole; reported through `done`
        errors = {**errors, -1: exc}
        signals.stop(LayerFailure.of(position, exc))
    stopped = signals.failure
    try:
        if on_layer is not None and stopped is not None:
            on_layer(stopped.position, stopped)
        item.done(errors)
    except Exception:  # a dead completion thread would leave every later walk unheard
        log.exception("completion thread: a walk's callback raised; later walks go on")
