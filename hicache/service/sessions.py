"""What the engine server keeps per engine: `Session` (its namespace, mapped pools, counter
file, the memory it claims, unreleased loads, the prefault of its memory), `LoadEntry`,
`Prefaulting`, the `DrainReport`.

A session's states: open (connected) -> said hello (`key`) -> registered (`memory` claimed,
`claims.py`; `pools` attached) -> connection gone (`lost`: `gone` set, `ending`) -> ended
(`EngineServer.end`: every op settled, then `memory` released and `ended` set). Its id is
the epoch every reply of a registration, store and load carries, so an engine can tell which
session answered."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field

from hicache.channel.counters import CounterFile
from hicache.channel.shm import PeerMemory
from hicache.memory import DevicePool
from hicache.scheduler import OpHandle
from hicache.service.namespaces import Namespace, NamespaceKey


@dataclass
class LoadEntry:
    slot: int
    handle: OpHandle
    released: bool = False


log = logging.getLogger("hicache.service")


@dataclass
class Prefaulting:
    """A session's mapped pool being prefaulted on the sidecar's prefault thread
    (`PeerMemory.prefault`): the sidecar's page tables for the engine's allocated pages filled
    once, after the registration was answered, so no load or store faults on them later. One
    thread for every session (`ServerState.prefaults`, one pool at a time: never more than a
    core, never a worker L3's I/O needs). A task of the service's TaskGroup; `stop` (the
    session's end) takes it off the queue, or has the thread stop after its chunk — the
    thread holds its own reference to the mapping, so nothing it touches is unmapped under
    it."""

    task: asyncio.Task[None]
    _stop: threading.Event

    @classmethod
    def start(
        cls,
        tg: asyncio.TaskGroup,
        executor: Executor,
        memory: PeerMemory,
        session: int,
        pid: int | None,
    ) -> Prefaulting:
        stop = threading.Event()

        async def run() -> None:
            loop = asyncio.get_running_loop()
            started = time.perf_counter()
            try:
                done = await loop.run_in_executor(executor, memory.prefault, stop)
            except Exception as exc:  # never the service's end: copies fault as they go
                log.warning(
                    "engine memory not prefaulted",
                    extra={"fields": {"session": session, "pid": pid, "reason": str(exc)}},
                )
                return
            log.info(
                "engine memory prefaulted",
                extra={
                    "fields": {
                        "session": session,
                        "pid": pid,
                        "bytes": done,
                        "seconds": round(time.perf_counter() - started, 3),
                        "stopped": stop.is_set(),
                    }
                },
            )

        return cls(tg.create_task(run(), name=f"hicache-prefault-{session}"), stop)

    async def stop(self) -> None:
        self._stop.set()
        self.task.cancel()  # queued: it never runs; running: the thread ends after its chunk
        await asyncio.wait([self.task])


# what names a piece of an engine's memory: a memfd's (st_dev, st_ino), or a CUDA
# allocation's ("cuda", device, IPC handle)
MemoryId = tuple[object, ...]


@dataclass
class Session:
    id: int
    transport: asyncio.Transport
    last_seen: float
    engine: str = ""
    pid: int = 0  # as the engine says in hello (its own pid namespace's view)
    unix: bool = False  # came over the Unix socket (TCP: no peer the kernel names)
    peer_pid: int | None = None  # the Unix socket's peer as the kernel says (SO_PEERCRED)
    peer_start: int | None = None  # its start time (clock ticks since boot): not a reused pid
    key: NamespaceKey | None = None
    namespace: Namespace | None = None
    pools: dict[str, DevicePool] | None = None
    counters: CounterFile | None = None
    memory: list[MemoryId] = field(default_factory=list)  # claimed (claims.py) until ended
    loads: dict[int, LoadEntry] = field(default_factory=dict)
    free_slots: list[int] = field(default_factory=list)
    in_request: int = 0  # awaited requests in progress: a busy engine is not a silent one
    lookup_only: bool = False  # hello role "lookup": no pools, no stores or loads
    ending: asyncio.Task[None] | None = None  # set once its connection is gone
    # set once its connection is gone: no reply is read any more, so a wait for one ends
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    prefault: Prefaulting | None = None  # its pool's page tables being filled
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # every op settled, memory free

    def lost(self, ending: asyncio.Task[None]) -> None:
        """Its connection is gone: waits whose reply no one reads end now (`gone`), and
        `ending` ends the session once its op in hand settled."""
        self.gone.set()
        self.ending = ending

    @property
    def connection_gone(self) -> bool:
        """Its socket closed (or is closing): nothing new arrives; it ends once its ops settle."""
        return self.ending is not None or self.transport.is_closing()

    def loads_running(self) -> int:
        return sum(1 for entry in self.loads.values() if entry.handle.result is None)

    def describe(self) -> str:
        who = f"session {self.id}"
        pid = self.peer_pid or self.pid
        if self.engine or pid:
            who += f" ({self.engine or 'engine'} pid {pid})"
        return who


@dataclass(frozen=True, slots=True)
class DrainReport:
    loads_finished: int
    loads_cancelled: int
    pages_flushed: int
    pages_unflushed: int = 0  # owed to L3, still unwritten at the drain's deadline
    bytes_unflushed: int = 0


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22): with
    the pid, names one process for good (pids are reused, start times with them never)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def same_process(pid: int, start: int | None) -> bool:
    return start is not None and process_start(pid) == start
