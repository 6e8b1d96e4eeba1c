"""`FakeCopyBackend`: the CPU backend with test controls, shipped for tests of everything above
the transfer layer (the scheduler, the service). It really copies; on top it can hold each
layer until the test releases it (`gate`), fail chosen layers, or add latency per layer.

    backend = FakeCopyBackend(gated=True)
    ... start a load ...
    backend.release(3)          # let three more layers run
    backend.fail_next({2})      # the next walk's layer 2 raises InjectedFault
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from hicache.transfer.backend import Direction, LayerPart
from hicache.transfer.cpu_backend import CpuCopyBackend


class InjectedFault(RuntimeError):
    """A failure the fake backend was told to raise."""


class FakeCopyBackend(CpuCopyBackend):
    def __init__(self, *, gated: bool = False, layer_delay_s: float = 0.0):
        self._gated = gated
        self._permits = threading.Semaphore(0)
        self._fail_positions: set[int] = set()
        self._fail_lock = threading.Lock()
        self.layer_delay_s = layer_delay_s
        self.layers_run = 0
        super().__init__(staging_bytes=1 << 20)

    def release(self, layers: int = 1) -> None:
        for _ in range(layers):
            self._permits.release()

    def open_gate(self) -> None:
        """Stop gating: every layer from now on runs without a permit."""
        self._gated = False
        self.release(1 << 16)

    def close_gate(self) -> None:
        """Gate again from zero permits: every layer from now on waits for `release`."""
        self._permits = threading.Semaphore(0)
        self._gated = True

    def fail_next(self, positions: set[int]) -> None:
        """Fail these layer positions of the coming walks (each position once)."""
        with self._fail_lock:
            self._fail_positions |= positions

    def _run_layer(self, direction: Direction, position: int, parts: Sequence[LayerPart]) -> None:
        if self._gated:
            self._permits.acquire()
        if self.layer_delay_s:
            time.sleep(self.layer_delay_s)
        with self._fail_lock:
            fail = position in self._fail_positions
            self._fail_positions.discard(position)
        if fail:
            raise InjectedFault(f"injected fault at layer position {position}")
        super()._run_layer(direction, position, parts)
        self.layers_run += 1

    def close(self) -> None:
        self.open_gate()
        super().close()
