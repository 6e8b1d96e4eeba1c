"""The layer-done counter: per in-flight load, which layers have landed.

Indices are stage-local layer positions (`LayerMap.stage_index`: global id - start_layer), so a
counter covers every layer of the stage, holes included. Lifecycle of one load's counter:
`CounterRing.acquire` -> `submitted(walk)` once the whole walk is on the backend, before the
handle reaches the consumer -> the consumer's `wait_layer(i)` -> `CounterRing.release`.
`wait_layer` on a layer that was never submitted, or after release, is a protocol error
(`CounterMisuseError`): on CUDA a wait on an unrecorded event is silently a no-op, which is
exactly the bug this guards against. `NOOP_COUNTER` serves when nothing loads, so callers
never write `if counter is not None`.

A walk that stopped (a layer's copy failed, or it was cancelled: `LayerFailure`) never lands
the layers from its stop on: `wait_layer(i)` returns that stop for them, also after the
release (the counter keeps it), and None for the layers that landed before it. The counter
knows positions only; the handle that holds it names the load and the layer and raises
(`OpHandle.wait_layer` -> `LayerLoadError`). `StoppedCounter` stands in for a load that
ended before its walk was submitted.
"""

from __future__ import annotations

import abc
import threading

from hicache.errors import CounterMisuseError
from hicache.transfer.backend import LayerFailure, WalkSignals


class LayerDoneCounter(abc.ABC):
    @abc.abstractmethod
    def wait_layer(self, index: int) -> LayerFailure | None:
        """Return None when layer `index` (stage-local) of this load may be read (CPU: has
        landed; CUDA: the caller's stream is ordered after it), or the stop that keeps it
        from ever landing. The caller must raise on a stop."""


class NoopCounter(LayerDoneCounter):
    def wait_layer(self, index: int) -> LayerFailure | None:
        return None


NOOP_COUNTER = NoopCounter()


class StoppedCounter(LayerDoneCounter):
    """A load that ended before its walk was submitted (cancelled or expired while queued,
    the scheduler shut down, the backend refused the walk): no layer will land."""

    def __init__(self, failure: LayerFailure):
        self.failure = failure

    def wait_layer(self, index: int) -> LayerFailure | None:
        return self.failure if index >= self.failure.position else None


class LoadCounter(LayerDoneCounter):
    def __init__(self, ring: CounterRing, slot: int, load_id: int, num_layers: int):
        self.ring = ring
        self.slot = slot
        self.load_id = load_id
        self.num_layers = num_layers
        self._walk: WalkSignals | None = None
        self._released = False
        self._completed = False
        self._stopped: LayerFailure | None = None  # the walk's stop, kept at release
        self._lock = threading.Lock()

    def submitted(self, walk: WalkSignals) -> None:
        """The load's whole walk is on the backend: every layer has a signal from now on."""
        with self._lock:
            if self._released:
                raise CounterMisuseError(
                    f"load {self.load_id}: walk submitted after the counter was released"
                )
            if self._walk is not None:
                raise CounterMisuseError(f"load {self.load_id}: walk submitted twice")
            self._walk = walk

    def wait_layer(self, index: int) -> LayerFailure | None:
        self._check_index(index)
        with self._lock:
            if self._released:
                if self._completed:
                    return None  # every layer landed before the release: nothing to wait for
                stopped = self._stopped
                if stopped is not None:  # the walk ended at its stop: it stays stopped
                    return stopped if index >= stopped.position else None
                raise CounterMisuseError(
                    f"load {self.load_id}'s counter was released before its walk completed "
                    f"(slot {self.slot} of the ring may serve another load now)"
                )
            walk = self._walk
        if walk is None:
            raise CounterMisuseError(
                f"load {self.load_id}: layer {index} was never submitted; every layer of a load "
                "is submitted before its handle is returned, so this wait would not be ordered "
                "after any copy"
            )
        return walk.wait(index)

    def _check_index(self, index: int) -> None:
        if not isinstance(index, int) or not 0 <= index < self.num_layers:
            raise CounterMisuseError(
                f"load {self.load_id}: layer index {index!r} is outside 0..{self.num_layers - 1} "
                "(stage-local indices; convert with LayerMap.stage_index)"
            )


class CounterRing:
    """A fixed number of counter slots: at most `size` loads in flight at once. The
    invariant — a slot serves one load at a time — is checked on every acquire and release."""

    def __init__(self, size: int):
        if size < 1:
            raise CounterMisuseError(f"a counter ring needs at least 1 slot; got {size}")
        self.size = size
        self._slots: list[LoadCounter | None] = [None] * size
        self._next = 0
        self._lock = threading.Lock()

    def acquire(self, load_id: int, num_layers: int) -> LoadCounter:
        with self._lock:
            for step in range(self.size):
                slot = (self._next + step) % self.size
                if self._slots[slot] is None:
                    counter = LoadCounter(self, slot, load_id, num_layers)
                    self._slots[slot] = counter
                    self._next = (slot + 1) % self.size
                    return counter
            busy = [c.load_id for c in self._slots if c is not None]
        raise CounterMisuseError(
            f"counter ring of {self.size} slots is full (loads {busy} in flight); finish one "
            "before starting another, or raise scheduler.counter_ring_size"
        )

    def release(self, counter: LoadCounter) -> None:
        with self._lock:
            if self._slots[counter.slot] is not counter:
                raise CounterMisuseError(
                    f"load {counter.load_id}'s counter is not in slot {counter.slot}; "
                    "it was released already"
                )
            with counter._lock:
                counter._released = True
                walk = counter._walk
                counter._completed = walk is not None and walk.all_done(counter.num_layers)
                counter._stopped = walk.failure if walk is not None else None
            self._slots[counter.slot] = None

    @property
    def in_flight(self) -> int:
        with self._lock:
            return sum(c is not None for c in self._slots)
