"""What the engine server keeps per engine: `Session` (its namespace, mapped pools, counter
file, unreleased loads), `LoadEntry`, the `DrainReport`, and the process and file checks used
when an engine goes away."""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from hicache.memory import DevicePool
from hicache.scheduler import OpHandle
from hicache.service.namespaces import Namespace, NamespaceKey
from hicache.service.shm import CounterFile


@dataclass
class LoadEntry:
    slot: int
    handle: OpHandle
    released: bool = False


@dataclass
class Session:
    id: int
    transport: asyncio.Transport
    last_seen: float
    engine: str = ""
    pid: int = 0
    key: NamespaceKey | None = None
    namespace: Namespace | None = None
    pools: dict[str, DevicePool] | None = None
    pool_path: Path | None = None
    counters: CounterFile | None = None
    loads: dict[int, LoadEntry] = field(default_factory=dict)
    free_slots: list[int] = field(default_factory=list)
    in_request: int = 0  # awaited requests in progress: a busy engine is not a silent one
    lookup_only: bool = False  # hello role "lookup": no pools, no stores or loads

    def describe(self) -> str:
        who = f"session {self.id}"
        if self.engine or self.pid:
            who += f" ({self.engine or 'engine'} pid {self.pid})"
        return who


@dataclass(frozen=True, slots=True)
class DrainReport:
    loads_finished: int
    loads_cancelled: int
    pages_flushed: int


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (exited, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def remove_under(path: Path, root: Path) -> None:
    with contextlib.suppress(OSError):
        if path.resolve().is_relative_to(root.resolve()):
            path.unlink()
