"""What the engine client hands back: `Lookup`, `LoadHandle` (`wait_layer` reads the load's
counter in shared memory; `done()` / `finished()` wait for its end and free its slot, and let
go of its CUDA fence event), and the client's errors.

A load whose walk stopped at layer k (a copy failed, or the load was cancelled: the sidecar
writes the stop into the row at once, shm.py) makes `wait_layer(i)` raise `LayerLoadError`
for every i >= k, naming the load, the layer and the cause read from the row; layers before k
return. A layer that owns no cache returns (nothing of any load lives there). The check costs
nothing on the fast path: a landed layer returns after one read of `layers_done`. After
`done()` the handle keeps the outcome, since the slot may serve another load by then."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any

from hicache.channel.counters import CounterFile, LoadState
from hicache.errors import HicacheError, LayerLoadError
from hicache.model import LayerMap
from hicache.transfer import LayerFailure


class ClientError(HicacheError):
    """The sidecar answered with an error (`code` is one of protocol.ErrorCode)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class SidecarUnreachableError(HicacheError, ConnectionError):
    """`connect` (or a reconnect) found no sidecar: the message names the address tried and
    why (no such file, connection refused, permission denied, timed out)."""


@dataclass(frozen=True, slots=True)
class Epoch:
    """Which session of which sidecar process an op ran in: `sidecar`, the process as the
    kernel named the socket's peer ((pid, start time); None where it did not), and `session`,
    the session id its replies carry (0: unknown). A session ends once, with every copy of
    it; `ClientBase.confirmed` says when this client knows that it did."""

    sidecar: tuple[int, int | None] | None
    session: int


class NoReplyError(TimeoutError):
    """A request got no reply in time. The sidecar may still be running it in `epoch`: its
    copies may still read or write the engine's memory until that session ended, which a
    later registration of the same memory (or the sidecar's exit) confirms
    (`ClientBase.confirmed`)."""

    def __init__(self, op: str, epoch: Epoch, timeout_s: float):
        super().__init__(
            f"{op}: no reply from the sidecar in {timeout_s:g} s (session {epoch.session}); "
            "it may still be running there: the next call reconnects, and the sidecar "
            "registers this engine's memory again only once that session ended"
        )
        self.op = op
        self.epoch = epoch


class LoadFailedError(HicacheError):
    """A layer did not land, or a load did not end, within the caller's timeout. (A layer
    that will never land raises `LayerLoadError`.)"""


class LoadLostError(HicacheError):
    """The connection (and its load slots) went away while the load was in flight."""


@dataclass(frozen=True, slots=True)
class Lookup:
    page_size_tokens: int
    tokens_l2: int
    tokens_total: int
    # a lookup with `wait_stored_s` that waited for a store in flight: how the wait ended
    # ("hit", "missed", "timed_out", "drained"); None: it did not wait
    store_wait: str | None = None
    # a store in flight writes the page right past the hit now (the engine may ask again
    # later); None: the sidecar predates saying so
    store_writing: bool | None = None


_STATES = {
    LoadState.DONE: "done",
    LoadState.FAILED: "failed",
    LoadState.CANCELLED: "cancelled",
}


class LoadHandle:
    """One load: `wait_layer(layer_id)` from the engine's forward thread; `done()` at the end."""

    def __init__(
        self,
        release: Any,
        layer_map: LayerMap,
        counters: CounterFile,
        generation: int,
        current_generation: Any,
        reply: dict[str, Any],
        stalls: list[float],
    ):
        self.load_id: int = reply["load_id"]
        self.slot: int = reply["slot"]
        self.tokens: int = reply["tokens"]
        self.failed: dict[str, list[int]] = reply["failed"]
        # the session whose end settles this load's copies (`ClientBase._handle` sets it)
        self.epoch = Epoch(None, 0)
        self._release = release
        self._layer_map = layer_map
        self._counters = counters
        self._row = counters.array[self.slot]
        self._generation = generation
        self._current = current_generation
        self._stalls = stalls
        self._final: str | None = None
        self._cancelled = False  # released while running (`cancel`)
        self._stopped: LayerFailure | None = None  # read from the row when the load ended
        # CUDA pools: the engine's fence event of this load, alive until the load ended (the
        # sidecar's copies wait on its imported copy; client/base.py `_engine_fence`)
        self.fence_event: Any = None
        # ns from a layer landing (sidecar's clock) to this engine seeing it, for the layers
        # it had to wait for; CLOCK_MONOTONIC is one clock for every process of the machine
        self.signal_ns: list[int] = []

    def settled_by(self, epoch: Epoch) -> LoadHandle:
        """Name the session whose end settles this load's copies."""
        self.epoch = epoch
        return self

    def _check(self) -> None:
        if self._current() != self._generation or int(self._row[0]) != self.load_id:
            raise LoadLostError(
                f"load {self.load_id}: the sidecar connection was reset while it was in flight"
            )

    def wait_layer(self, layer_id: int, timeout_s: float = 60.0) -> None:
        index = self._layer_map.stage_index(layer_id)
        row = self._row
        if row[1] > index and self._final is None:
            return
        if self._final is not None:  # ended and released: the row may serve another load
            self._raise_if_stopped(layer_id, index, self._stopped)
            return
        started = time.perf_counter()
        spins = 0
        while row[1] <= index:
            if row[5]:  # the walk stopped at layers_done: this layer will never land
                self._raise_if_stopped(layer_id, index, self._counters.failure(self.slot))
                return
            self._check()
            spins += 1
            if spins < 2000:
                os.sched_yield()  # the copy thread may need this core
            else:
                time.sleep(50e-6)
                if time.perf_counter() - started > timeout_s:
                    raise LoadFailedError(
                        f"load {self.load_id}: layer {layer_id} did not land in {timeout_s} s"
                    )
        seen = time.monotonic_ns()
        if row[1] == index + 1:
            self.signal_ns.append(seen - int(row[4]))
        self._stalls.append(time.perf_counter() - started)

    def _raise_if_stopped(self, layer_id: int, index: int, stopped: LayerFailure | None) -> None:
        if stopped is None or index < stopped.position or not self._layer_map.slots(layer_id):
            return
        stop_layer = self._layer_map.stage_layer_ids[stopped.position]
        raise LayerLoadError(self.load_id, layer_id, stopped.cause(layer_id, stop_layer))

    def state(self) -> str:
        """running / done / failed / cancelled. A load that ended before its connection was
        reset keeps its final state (the old counter mapping is never reused)."""
        if self._final is not None:
            return self._final
        ours = int(self._row[0]) == self.load_id
        if ours:
            final = _STATES.get(LoadState(int(self._row[2])))
            if final is not None:
                return final
        # released while running: the sidecar frees its slot the moment it ends (writing its
        # final state and FREE back to back, so the final state may never be seen), and only
        # then; a freed, or already reused, slot means it ended
        freed = not ours or LoadState(int(self._row[2])) is LoadState.FREE
        if self._cancelled and freed and self._current() == self._generation:
            return "cancelled"
        self._check()
        return "running"

    def done(self, timeout_s: float = 60.0) -> str:
        """Wait for the load to end; returns done / failed / cancelled and frees its slot."""
        deadline = time.perf_counter() + timeout_s
        while (state := self._poll(deadline, timeout_s)) is None:
            time.sleep(20e-6)
        return state

    async def finished(self, timeout_s: float = 60.0) -> str:
        """`done()` for an event loop: waits without blocking it."""
        deadline = time.perf_counter() + timeout_s
        # the state is a word another process writes in shared memory: nothing to await on
        while (state := self._poll(deadline, timeout_s)) is None:  # noqa: ASYNC110
            await asyncio.sleep(100e-6)
        return state

    def _poll(self, deadline: float, timeout_s: float) -> str | None:
        """The final state once the load ended (its slot released then), else None."""
        if self._final is not None:
            return self._final
        state = self.state()
        if state == "running":
            if time.perf_counter() > deadline:
                raise LoadFailedError(f"load {self.load_id} did not end in {timeout_s} s")
            return None
        self._final = state
        if int(self._row[0]) == self.load_id:  # still this load's row (not a reused slot)
            self._stopped = self._counters.failure(self.slot)
        self.fence_event = None  # the load ended: nothing of it can wait on the fence now
        self._release(self.load_id)
        return state

    def cancel(self) -> None:
        """Release a load still running: the sidecar stops its walk at the next layer; `done()`
        then waits for its end ("cancelled" once its slot was freed)."""
        if self._final is None:
            self._release(self.load_id)
            self._cancelled = True
