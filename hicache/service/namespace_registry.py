"""`NamespaceRegistry`: the one place a namespace key gets its `Namespace`, whatever arrives at
once — so engines registering together share one cache, and the drain reaches every
namespace ever started.

Lifecycle of a key (`NamespacePhase`):

    (absent) --first register_pools--> starting --start ends--> running --drain--> draining
        ^                                 |  \\                                       |
        +------- the start failed --------+   +--drain begins meanwhile--> draining   v
                                                                                   closed

- absent -> starting: the first registration of the key creates the entry and its start
  task (a task of the service's TaskGroup, so no session's fate cancels it); every
  registration of the key that arrives while it is starting waits for that same start.
- starting -> running: the start task built the namespace (`Namespace.start`); every waiter
  attaches to it. The entry is the only record: there is no second namespace of a key.
- starting -> absent: the start failed; every waiter is refused with the cause
  (`REFUSED`, naming the key and the error), nothing of it is kept, and a later
  registration starts it afresh.
- starting | running -> draining (`begin_drain`, the drain's first step): registrations
  arriving from now on are refused, and so is every one still waiting for a start (the
  start itself goes on: the drain awaits it within its deadline, then closes what it built).
- draining -> closed (`close_all`): each namespace flushed within the drain's time left and
  its scheduler task stopped; a start or a close still running at the deadline is
  cancelled, so the service's TaskGroup always ends.

Which sessions each namespace holds (attached, and waiting for its start) and its phase are
in `snapshot`, shown by `/v1/stats` and `hicache stats`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hicache.channel import protocol as p
from hicache.memory import DevicePool
from hicache.service.checkpoints import checkpoint
from hicache.service.namespaces import Namespace, NamespaceKey

log = logging.getLogger("hicache.service")

Build = Callable[[NamespaceKey, dict[str, DevicePool]], Awaitable[Namespace]]


class NamespacePhase(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    CLOSED = "closed"


@dataclass
class NamespaceEntry:
    key: NamespaceKey
    phase: NamespacePhase
    settled: asyncio.Future[None]  # done once the start ended, either way
    task: asyncio.Task[None] | None = None  # the start task
    namespace: Namespace | None = None  # once started
    error: str | None = None  # why the start failed
    waiting: set[int] = field(default_factory=set)  # session ids waiting for the start


@dataclass(frozen=True, slots=True)
class Flushed:
    """What `close_all` flushed and left, over every namespace."""

    written: int = 0
    left_pages: int = 0
    left_bytes: int = 0
    unsettled: tuple[str, ...] = ()  # namespaces whose start or close ran past the deadline


class NamespaceRegistry:
    def __init__(
        self,
        running: dict[NamespaceKey, Namespace],
        tg: asyncio.TaskGroup,
        build: Build,
    ):
        self.running = running  # the started namespaces by key (what the ops read)
        self._tg = tg
        self._build = build
        self.entries: dict[NamespaceKey, NamespaceEntry] = {}
        self._closing: list[NamespaceEntry] = []  # drained entries: every one ever started
        self._draining = False
        self._drain_begun: asyncio.Future[None] | None = None

    @property
    def draining(self) -> bool:
        return self._draining

    def _refuse_draining(self, op: str, key: NamespaceKey) -> p.RequestError:
        return p.RequestError(
            p.ErrorCode.REFUSED,
            f"{op}: the sidecar is draining (shutting down); namespace {key} takes no new "
            "session: connect to the sidecar that replaces it",
        )

    async def namespace_for(
        self, key: NamespaceKey, session_id: int, pools: dict[str, DevicePool], op: str
    ) -> Namespace:
        """The running namespace of `key` for session `session_id` to attach to: started on
        the key's first registration (from `pools`), else the one starting or running.
        Refused while draining, or when the start it waited for failed (with the cause)."""
        if self._draining:
            raise self._refuse_draining(op, key)
        entry = self.entries.get(key)
        if entry is None:
            loop = asyncio.get_running_loop()
            entry = NamespaceEntry(key, NamespacePhase.STARTING, loop.create_future())
            self.entries[key] = entry
            entry.task = self._tg.create_task(
                self._start(entry, pools), name=f"hicache-start-{key}"
            )
        if entry.phase is NamespacePhase.STARTING:
            entry.waiting.add(session_id)
            try:
                await checkpoint("attach.start")
                await asyncio.wait(
                    [entry.settled, self._drain_signal()], return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                entry.waiting.discard(session_id)
        if self._draining:
            raise self._refuse_draining(op, key)
        if entry.namespace is None:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"{op}: namespace {key} failed to start: {entry.error}; nothing of it was "
                "kept: register_pools again to retry",
            )
        return entry.namespace

    def _drain_signal(self) -> asyncio.Future[None]:
        if self._drain_begun is None:
            self._drain_begun = asyncio.get_running_loop().create_future()
        return self._drain_begun

    async def _start(self, entry: NamespaceEntry, pools: dict[str, DevicePool]) -> None:
        """The start task: never raises into the TaskGroup (a failed start is the waiters'
        error, not the service's end)."""
        try:
            await checkpoint("namespace.build")
            namespace = await self._build(entry.key, pools)
        except Exception as exc:
            entry.error = " ".join(f"{type(exc).__name__}: {exc}".split())
            if self.entries.get(entry.key) is entry:
                del self.entries[entry.key]  # a later registration starts afresh
            entry.phase = NamespacePhase.CLOSED
            log.warning(
                "namespace start failed",
                extra={"fields": {"namespace": str(entry.key), "reason": entry.error}},
            )
        except BaseException:  # cancelled (the drain's deadline): nothing was recorded
            entry.error = "its start was cancelled (the sidecar is shutting down)"
            entry.phase = NamespacePhase.CLOSED
            entry.settled.set_result(None)
            raise
        else:
            entry.namespace = namespace
            self.running[entry.key] = namespace
            if entry.phase is NamespacePhase.STARTING:
                entry.phase = NamespacePhase.RUNNING
        entry.settled.set_result(None)

    # ---- drain ----------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Refuse new registrations and those waiting for a start; every entry draining."""
        self._draining = True
        signal = self._drain_signal()
        if not signal.done():
            signal.set_result(None)  # wakes every registration waiting for a start
        for entry in self.entries.values():
            entry.phase = NamespacePhase.DRAINING
            self._closing.append(entry)
        self.entries.clear()  # no key is looked up again

    async def close_all(self, deadline: float) -> Flushed:
        """Every namespace ever started: its start awaited, what it owes L3 flushed and its
        scheduler stopped, all by `deadline` (loop time); what runs past it is cancelled."""
        loop = asyncio.get_running_loop()
        written = left_pages = left_bytes = 0
        unsettled: list[str] = []
        for entry in self._closing:
            if not entry.settled.done():
                await asyncio.wait([entry.settled], timeout=max(0.0, deadline - loop.time()))
            if not entry.settled.done() and entry.task is not None:
                entry.task.cancel()  # a start that would outlive the drain
                await asyncio.wait([entry.task])
                unsettled.append(f"{entry.key} (start)")
            namespace = entry.namespace
            if namespace is not None:
                result = await namespace.cache.flush_within(max(0.0, deadline - loop.time()))
                written += result.written
                left_pages += result.left_pages
                left_bytes += result.left_bytes
                if not await namespace.close(max(0.0, deadline - loop.time())):
                    unsettled.append(f"{entry.key} (close)")
            entry.phase = NamespacePhase.CLOSED
        return Flushed(written, left_pages, left_bytes, tuple(unsettled))

    def snapshot(self) -> list[dict[str, Any]]:
        """Each namespace's phase, the sessions attached and those waiting for its start."""
        out = []
        for entry in [*self._closing, *self.entries.values()]:
            attached = sorted(entry.namespace.attached) if entry.namespace is not None else []
            out.append(
                {
                    "namespace": str(entry.key),
                    "state": entry.phase.value,
                    "sessions": attached,
                    "waiting_sessions": sorted(entry.waiting),
                }
            )
        return out
