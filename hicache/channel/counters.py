"""Per-load layer counters in shared memory: how the engine sees each layer of a load land
without a message per layer. The file is a sealed memfd made by the engine
(`shm.sealed_memfd`), mapped by the sidecar through `shm.map_peer_fd` like the pools.

Counter file: one per registration, `slots` rows of six int64
`[load_id, layers_done, state, num_layers, landed_ns, stop]` (landed_ns: CLOCK_MONOTONIC when
the latest layer landed, so the engine can measure how late it saw it), then, per slot,
`CAUSE_BYTES` of UTF-8 (NUL-padded): why the load's walk stopped. A load's row is written
before its reply is sent; the copy thread bumps `layers_done` as layers land (stage-local
count); the op's end sets `state`. The engine's `wait_layer(i)` reads `layers_done > i` from its
own mapping — no message per layer, no syscall when the layer has landed.

A failed layer is written as a stop, as soon as the copy thread knows, before the load ends:
`layers_done` stays at the failed position k (it never passes a layer that did not land), the
cause text is written, then `stop` (a `StopKind` code: failed layer, cancelled, failed walk;
0 while none). `state` stays RUNNING until the op has really ended (its copies drained, its
pins released), so `done()` still means "ended"; only `wait_layer(i >= k)` changes: it sees
`stop` and raises at once. A load that ends failed or cancelled without its walk reporting a
stop (it never ran) gets one at `layers_done` from `end`, before its final state.

Aligned int64 stores are single writes on x86-64 and arm64, and each store follows the copy
(or the cause text) it reports in program order (x86-64 TSO; CUDA loads report after their
event).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import numpy as np
import torch

from hicache.channel.shm import map_fd, map_peer_fd, sealed_memfd
from hicache.transfer import LayerFailure, StopKind

COUNTER_FIELDS = 6  # load_id, layers_done, state, num_layers, landed_ns, stop
CAUSE_BYTES = 256  # per slot, after the rows: the stop's reason, UTF-8, NUL-padded


class LoadState(IntEnum):
    FREE = 0
    RUNNING = 1
    DONE = 2
    FAILED = 3
    CANCELLED = 4


class CounterFile:
    """Per-registration load counters in shared memory (`slots` rows of six int64, then a
    cause text per slot). The engine creates it (`create`: a sealed memfd, `fd` sent in
    register_pools); the sidecar maps the engine's descriptor (`of_peer`)."""

    def __init__(
        self,
        slots: int,
        array: np.ndarray[Any, np.dtype[np.int64]],
        causes: np.ndarray[Any, np.dtype[np.uint8]],
        tensor: torch.Tensor,
        fd: int = -1,
    ):
        self.slots = slots
        self.array = array
        self.causes = causes
        self.fd = fd
        self._tensor = tensor  # keeps the mapping alive

    @staticmethod
    def nbytes(slots: int) -> int:
        return max(slots * (COUNTER_FIELDS * 8 + CAUSE_BYTES), 8)

    @classmethod
    def create(cls, slots: int) -> CounterFile:
        fd = sealed_memfd("hicache-counters", cls.nbytes(slots))
        try:
            return cls._of(map_fd(fd, cls.nbytes(slots)), slots, fd)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def of_peer(
        cls, pid: int, fd: int, slots: int, alive: Callable[[], bool] = lambda: True
    ) -> tuple[CounterFile, tuple[int, int]]:
        memory = map_peer_fd(pid, fd, cls.nbytes(slots), "counters_fd", alive)
        return cls._of(memory.tensor, slots), memory.identity

    @classmethod
    def _of(cls, tensor: torch.Tensor, slots: int, fd: int = -1) -> CounterFile:
        raw = tensor.numpy()
        rows_end = slots * COUNTER_FIELDS * 8
        array = raw[:rows_end].view(np.int64).reshape(slots, COUNTER_FIELDS)
        causes = raw[rows_end : rows_end + slots * CAUSE_BYTES].reshape(slots, CAUSE_BYTES)
        return cls(slots, array, causes, tensor, fd)

    def close(self) -> None:
        """Close the engine's descriptor (idempotent); the mapping stays while referenced."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def start(self, slot: int, load_id: int, num_layers: int) -> None:
        row = self.array[slot]
        row[1] = 0
        row[3] = num_layers
        row[4] = 0
        row[5] = 0
        self.causes[slot] = 0
        row[2] = LoadState.RUNNING
        row[0] = load_id

    def stop(self, slot: int, failure: LayerFailure) -> None:
        """The load's walk stopped (the copy thread, before the op ends): the cause text, then
        the stop code; `layers_done` already holds `failure.position`."""
        text = failure.reason.encode()[:CAUSE_BYTES].decode(errors="ignore").encode()
        cause = self.causes[slot]
        cause[:] = 0
        cause[: len(text)] = np.frombuffer(text, dtype=np.uint8)
        self.array[slot][5] = failure.kind

    def end(self, slot: int, state: LoadState, reason: str) -> None:
        """The op ended (the event loop): a failed or cancelled load whose walk reported no
        stop (it never ran) gets one at `layers_done`, then `state` is set."""
        row = self.array[slot]
        if state is not LoadState.DONE and int(row[5]) == 0:
            kind = StopKind.CANCELLED if state is LoadState.CANCELLED else StopKind.FAILED_WALK
            self.stop(slot, LayerFailure(int(row[1]), kind, reason or state.name.lower()))
        row[2] = state

    def failure(self, slot: int) -> LayerFailure | None:
        """The stop a slot's row holds (read after `stop` was seen set), or None."""
        row = self.array[slot]
        code = int(row[5])
        if code == 0:
            return None
        reason = self.causes[slot].tobytes().rstrip(b"\0").decode(errors="replace")
        return LayerFailure(int(row[1]), StopKind(code), reason)
