"""Frozen snapshots of the scheduler's state; metrics and the CLI read these, never the live
objects. `StatsRecorder` is the mutable side the scheduler and handles write (thread-safe for
the per-layer stall the engine's threads report)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from hicache.scheduler.ops import OpKind, OpState


@dataclass(frozen=True, slots=True)
class DirectionStats:
    ops: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    queued_loads: int
    queued_backups: int
    in_flight_bytes: int
    in_flight_walks: int
    ops_by_state: Mapping[str, int]
    load: DirectionStats
    backup: DirectionStats
    layer_wait_s: tuple[float, ...]  # per stage layer: time consumers blocked in wait_layer
    layer_waits: int = 0
    merged_walks: int = 0
    extra: Mapping[str, float] = field(default_factory=dict)

    @property
    def total_stall_s(self) -> float:
        return sum(self.layer_wait_s)


class StatsRecorder:
    def __init__(self, num_stage_layers: int):
        self._lock = threading.Lock()
        self.states: Counter[str] = Counter()
        self.direction: dict[OpKind, DirectionStats] = {k: DirectionStats() for k in OpKind}
        self.layer_wait_s = [0.0] * num_stage_layers
        self.layer_waits = 0
        self.merged_walks = 0

    def transition(self, old: OpState | None, new: OpState) -> None:
        if old is not None:
            self.states[old.value] -= 1
        self.states[new.value] += 1

    def moved(self, kind: OpKind, nbytes: int, seconds: float) -> None:
        d = self.direction[kind]
        self.direction[kind] = DirectionStats(d.ops + 1, d.bytes + nbytes, d.seconds + seconds)

    def waited(self, index: int, seconds: float) -> None:
        with self._lock:
            self.layer_wait_s[index] += seconds
            self.layer_waits += 1

    def snapshot(
        self, queued_loads: int, queued_backups: int, in_flight_bytes: int, walks: int
    ) -> SchedulerStats:
        with self._lock:
            waits = tuple(self.layer_wait_s)
            count = self.layer_waits
        return SchedulerStats(
            queued_loads=queued_loads,
            queued_backups=queued_backups,
            in_flight_bytes=in_flight_bytes,
            in_flight_walks=walks,
            ops_by_state={k: v for k, v in self.states.items() if v},
            load=self.direction[OpKind.LOAD],
            backup=self.direction[OpKind.BACKUP],
            layer_wait_s=waits,
            layer_waits=count,
            merged_walks=self.merged_walks,
        )
