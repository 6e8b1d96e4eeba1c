"""`FakeCopyBackend`: the CPU backend with test controls, shipped for tests of everything above
the transfer layer (the scheduler, the service). It really copies; on top it can hold each
layer until the test releases it (`gate`), fail chosen layers, or add latency per layer.

    backend = FakeCopyBackend(gated=True)
    ... start a load ...
    backend.release(3)          # let three more layers start
    backend.fail_next({2})      # the next walk that reaches layer 2 fails there (InjectedFault)

The gate and the latency come before a layer's cancel check, so a walk cancelled while a
layer waits at the gate skips that layer. A failed layer stops its walk (backend.py), so a
walk never reaches the positions after it: `fail_next({2, 4})` fails one walk at 2 and leaves
4 armed for a later walk.

Processes a test cannot reach into (a sidecar child) get a fake with persistent faults by
running `python -m hicache.testing.serve --copy-faults JSON` instead of `hicache serve`;
`from_spec` says what the JSON may hold (`backup_hold_path`: a store held in flight while a
file exists). Nothing on the product's path reads a test switch.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from hicache.errors import ConfigError
from hicache.transfer.backend import Direction, LayerPart
from hicache.transfer.cpu_backend import CpuCopyBackend

_SPEC_KEYS = {"fail_load_layers", "load_layer_delay_s", "backup_layer_delay_s", "backup_hold_path"}
_HOLD_POLL_S = 0.01  # how often a held backup walk looks for its hold file gone


class InjectedFault(RuntimeError):
    """A failure the fake backend was told to raise."""


class FakeCopyBackend(CpuCopyBackend):
    def __init__(
        self,
        *,
        gated: bool = False,
        layer_delay_s: float = 0.0,
        load_layer_delay_s: float = 0.0,
        backup_layer_delay_s: float = 0.0,
        fail_load_layers: frozenset[int] = frozenset(),
        backup_hold_path: Path | None = None,
    ):
        self._gated = gated
        self._permits = threading.Semaphore(0)
        self._fail_positions: set[int] = set()
        self._fail_lock = threading.Lock()
        self.layer_delay_s = layer_delay_s  # before each layer of every walk
        self.load_layer_delay_s = load_layer_delay_s  # and of load walks only
        self.backup_layer_delay_s = backup_layer_delay_s  # and of backup (store) walks only
        self.fail_load_layers = fail_load_layers  # every load walk fails at these positions
        # while this file exists, every backup walk waits before each layer: a store held in
        # flight for as long as a test (in another process) wants
        self.backup_hold_path = backup_hold_path
        self.layers_run = 0
        super().__init__(staging_bytes=1 << 20)

    @classmethod
    def from_spec(cls, spec: str, where: str) -> FakeCopyBackend:
        """A fake from a JSON object (`where`: what gave it, as errors name it):
        `fail_load_layers` (stage-local positions at which every load walk fails),
        `load_layer_delay_s` (seconds before each layer of a load walk: time for a test to
        cancel a load mid-walk) and `backup_layer_delay_s` (likewise before each layer of a
        store's backup walk: a store that outlasts its engine's timeout) and
        `backup_hold_path` (while that file exists, backup walks wait: a store in flight
        until the test removes it)."""
        try:
            data = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: {spec!r} is not JSON ({exc.msg})") from None
        if not isinstance(data, dict) or set(data) - _SPEC_KEYS:
            raise ConfigError(
                f"{where}: {spec!r}; a JSON object with keys from {sorted(_SPEC_KEYS)}"
            )
        layers = data.get("fail_load_layers", [])
        if not isinstance(layers, list) or not all(isinstance(i, int) and i >= 0 for i in layers):
            raise ConfigError(
                f"{where}: fail_load_layers {layers!r}; a list of layer positions >= 0"
            )
        delays: dict[str, float] = {}
        for key in ("load_layer_delay_s", "backup_layer_delay_s"):
            delay = data.get(key, 0.0)
            if not isinstance(delay, int | float) or delay < 0:
                raise ConfigError(f"{where}: {key} {delay!r}; a number of seconds >= 0")
            delays[key] = float(delay)
        hold = data.get("backup_hold_path")
        if hold is not None and not isinstance(hold, str):
            raise ConfigError(f"{where}: backup_hold_path {hold!r}; a file path")
        return cls(
            load_layer_delay_s=delays["load_layer_delay_s"],
            backup_layer_delay_s=delays["backup_layer_delay_s"],
            fail_load_layers=frozenset(layers),
            backup_hold_path=None if hold is None else Path(hold),
        )

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
        """Fail these layer positions of the coming walks (each position once, in the first
        walk that reaches it)."""
        with self._fail_lock:
            self._fail_positions |= positions

    def _start_layer(self, direction: Direction, position: int) -> None:
        if self._gated:
            self._permits.acquire()
        hold = self.backup_hold_path
        if hold is not None and direction is Direction.BACKUP:
            while hold.exists():
                time.sleep(_HOLD_POLL_S)
        only = self.load_layer_delay_s if direction is Direction.LOAD else self.backup_layer_delay_s
        delay = self.layer_delay_s + only
        if delay:
            time.sleep(delay)

    def _run_layer(self, direction: Direction, position: int, parts: Sequence[LayerPart]) -> None:
        with self._fail_lock:
            fail = position in self._fail_positions
            self._fail_positions.discard(position)
        if fail or (direction is Direction.LOAD and position in self.fail_load_layers):
            raise InjectedFault(f"injected fault at layer position {position}")
        super()._run_layer(direction, position, parts)
        self.layers_run += 1

    def _stop(self, timeout_s: float | None) -> None:
        self.open_gate()  # a walk held at the gate must end: `close` and exit join it
        super()._stop(timeout_s)
