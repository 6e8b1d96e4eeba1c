"""`SidecarWorld`: the real engine server (`EngineServer`: its op handlers, namespaces, tiered
caches, schedulers and drain) inside the caller's event loop, with engines of this process
talking to it through the real dispatch path (`EngineServer.answer`), for the interleaving
explorer (`interleave.py`) and any test that must drive the sidecar's ops step by step.

What differs from `hicache serve`, and why:
- copies run on the event loop's thread (`InlineCopyBackend`: the CPU backend's walk, one
  loop callback per walk), so no copy thread races the explorer's test for a quiet loop;
  `fail_allocs` makes the next host allocations fail (a namespace whose start fails);
- L3 is `MemoryBackend` (a dict of objects behind the real `GuardedStore`, its default
  timeouts and breaker; the deployment's `storage` section is not read), so what reached
  L3 can be read back after the drain, and nothing waits on a disk;
- an engine's connection is `EngineLink`, the transport the server writes to and aborts: its
  `abort` ends the session as a real connection does (the op in hand finishes first, then
  `EngineServer.end`), and the session's peer is this process (its memfds are ours).

Lifecycle: `async with SidecarWorld.running(config) as world` builds the server in a fresh
TaskGroup -> `world.engine(name)` gives engines that `connect`, `hello`, `register`, `store`,
`load` (every loaded byte checked against what the token ids give: `WrongBytes`), `kill` ->
`world.drain()` (the server's drain; then `NamespaceLeak` if any namespace's task is still
running, instead of the TaskGroup waiting for it for good) -> the block's end drains if the
body did not, and closes the backend. `check_settled` asserts the invariants a scenario
checks after each ordering: one namespace per key, every live session attached to its key's
namespace, nothing pinned, reserved or attached that no live session holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import msgpack

from hicache.assembly.sidecar import sidecar_plan
from hicache.channel import protocol as p
from hicache.channel.counters import CounterFile
from hicache.channel.shm import SharedPools
from hicache.config import load_deployment
from hicache.demo.content import check_page, fill_page, seeds_for
from hicache.errors import TransferError
from hicache.service.metrics import ServiceMetrics
from hicache.service.namespaces import NamespaceKey
from hicache.service.server import EngineServer
from hicache.service.sessions import DrainReport, Session, process_start
from hicache.service.snapshots import namespace_stats
from hicache.storage import GuardedStore
from hicache.storage.backend import Buffer, StorageBackend
from hicache.transfer.backend import CancelToken, Direction, Fence, LayerPart
from hicache.transfer.cpu_backend import CpuCopyBackend, WalkProgress


class InlineCopyBackend(CpuCopyBackend):
    """The CPU backend whose walks run on the event loop's thread, each as one loop callback
    (the same `_walk`: every layer copied, `done` called after). `fail_allocs`: how many of
    the next host allocations raise `MemoryError` (a namespace start that fails)."""

    def __init__(self) -> None:
        super().__init__(staging_bytes=1 << 20)
        self.fail_allocs = 0

    def alloc_host(self, nbytes: int) -> Any:
        if self.fail_allocs:
            self.fail_allocs -= 1
            raise MemoryError(f"injected: a host allocation of {nbytes} bytes failed")
        return super().alloc_host(nbytes)

    def submit_walk(
        self,
        direction: Direction,
        layers: Sequence[Sequence[LayerPart]],
        done: Callable[[dict[int, BaseException]], None],
        after: Fence | None = None,
        cancel: CancelToken | None = None,
        on_layer: Callable[[int, Any], None] | None = None,
    ) -> WalkProgress:
        if self._closed:
            raise TransferError("the inline copy backend is closed; no new copies are accepted")
        progress = WalkProgress()
        asyncio.get_running_loop().call_soon(
            self._walk, direction, layers, done, cancel, progress, on_layer
        )
        return progress


class MemoryBackend(StorageBackend):
    """L3 as a dict of objects (key -> bytes): async, no thread, readable by the test."""

    name = "memory"

    def __init__(self) -> None:
        self.objects: dict[bytes, bytes] = {}

    async def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        for key, data in items:
            self.objects[bytes(key)] = bytes(data)
        return [True] * len(items)

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self.objects.get(bytes(k)) for k in keys]

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [bytes(k) in self.objects for k in keys]

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.objects.pop(bytes(key), None)

    async def close(self) -> None:
        return None


class EngineError(Exception):
    """An error reply: `code` (protocol.ErrorCode) and the message, as the engine reads it."""

    def __init__(self, op: str, code: str, message: str):
        super().__init__(f"{op}: {code}: {message}")
        self.code, self.message = code, message


class WrongBytes(AssertionError):
    """A loaded page whose bytes are not what its token prefix gives."""


class NamespaceLeak(AssertionError):
    """A namespace's scheduler (or start) task still runs after the drain returned: the
    service's TaskGroup would wait for it for good (the SIGTERM that never ends)."""


@dataclass
class EngineLink:
    """The transport the server holds for an engine session: `abort` / `close` end the
    session as a real connection's loss does (`EngineConnection._end`)."""

    engine: Engine
    closing: bool = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def write(self, data: bytes) -> None:
        return None

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        if self.closing:
            return
        self.closing = True
        session = self.engine.session
        if session is not None:
            session.lost(asyncio.ensure_future(self.engine._end("connection lost")))

    close = abort


@dataclass
class Engine:
    world: SidecarWorld
    name: str
    tenant: str = ""
    tp_rank: int = 0
    num_pages: int = 6
    session: Session | None = None
    pools: SharedPools | None = None
    counters: CounterFile | None = None
    link: EngineLink | None = None
    stored: list[list[int]] = field(default_factory=list)  # prompts whose store was acked
    _in_hand: asyncio.Future[None] | None = None  # the op being answered
    _ids: int = 0

    @property
    def key(self) -> NamespaceKey:
        return NamespaceKey(self.tp_rank, self.tenant)

    def connect(self) -> Engine:
        """A session, its peer this process (the kernel would name it)."""
        self.link = EngineLink(self)
        session = self.world.server.open(cast(asyncio.Transport, self.link))
        if session is None:
            raise EngineError("connect", "busy", "the server refused the connection")
        session.unix, session.peer_pid = True, os.getpid()
        session.peer_start = process_start(os.getpid())
        self.session = session
        return self

    async def call(self, op: str, **args: Any) -> dict[str, Any]:
        """One request through the server's dispatch (`answer`); an error reply raises
        `EngineError`. A session ending meanwhile awaits it (the op in hand)."""
        assert self.session is not None, "connect first"
        assert self.link is not None
        if self.link.closing:  # a lost connection dispatches nothing more (connection.py)
            raise EngineError(op, "connection_lost", "the engine's connection is gone")
        self._ids += 1
        body = p.frame({"op": op, "id": self._ids, "args": args})[p.HEADER.size :]
        self._in_hand = asyncio.get_running_loop().create_future()
        try:
            reply = await self.world.server.answer(self.session, body)
        finally:
            self._in_hand.set_result(None)
        decoded = msgpack.unpackb(reply[p.HEADER.size :])
        if "error" in decoded:
            raise EngineError(op, decoded["error"]["code"], decoded["error"]["message"])
        return cast(dict[str, Any], decoded["result"])

    async def hello(self) -> dict[str, Any]:
        return await self.call(
            "hello",
            protocol=p.PROTOCOL_VERSION,
            layout=self.world.server.state.layout,
            engine=self.name,
            pid=os.getpid(),
            tp_rank=self.tp_rank,
            tenant=self.tenant,
        )

    async def register(self) -> dict[str, Any]:
        geometries = self.world.server.state.geometries
        self.pools = SharedPools.create(geometries, self.num_pages)
        self.counters = CounterFile.create(self.world.server.service.load_slots)
        return await self.call(
            "register_pools", **self.pools.manifest(), counters_fd=self.counters.fd
        )

    async def start(self) -> Engine:
        """connect, hello and register."""
        self.connect()
        await self.hello()
        await self.register()
        return self

    def _pages(self, tokens: Sequence[int], first: int) -> dict[str, list[int]]:
        assert self.pools is not None
        full = len(tokens) // self.world.page_size
        return {
            g: [(first + i) % self.num_pages for i in range(full)] for g in self.pools.geometries
        }

    async def store(self, tokens: Sequence[int], first: int = 0, **args: Any) -> dict[str, Any]:
        """Prefill `tokens` into pages `first..` (bytes from the token ids) and store them
        (`args`: the store's other fields, `persisted_within_s`)."""
        assert self.pools is not None
        pages = self._pages(tokens, first)
        device = self.pools.device_pools()
        for group, ids in pages.items():
            seeds = seeds_for(tokens, group, True, self.world.page_size)
            for page, seed in zip(ids, seeds, strict=True):
                fill_page(device[group], page, seed)
        result = await self.call("store", tokens=list(tokens), device_pages=pages, **args)
        self.stored.append(list(tokens))
        return result

    async def load(self, tokens: Sequence[int], first: int = 0) -> int:
        """Load `tokens` into pages `first..` (zeroed first), await its end, check every
        loaded byte (`WrongBytes`), release it; the tokens loaded."""
        assert self.pools is not None
        assert self.session is not None
        pages = self._pages(tokens, first)
        device = self.pools.device_pools()
        for group, ids in pages.items():
            for page in ids:
                for layer in range(device[group].geometry.num_layers):
                    for rows in device[group].layer_rows(layer):
                        rows[page].zero_()
        reply = await self.call("load", tokens=list(tokens), device_pages=pages)
        if reply["load_id"] is None:
            return 0
        entry = self.session.loads.get(reply["load_id"])
        if entry is not None:
            await entry.handle.done()
        loaded = reply["tokens"] // self.world.page_size
        for group, ids in pages.items():
            seeds = seeds_for(tokens, group, True, self.world.page_size)
            for i in range(loaded):
                if not check_page(device[group], ids[i], seeds[i]):
                    raise WrongBytes(
                        f"{self.name}: page {i} of group {group} (device page {ids[i]}) holds "
                        f"other bytes than tokens[:{(i + 1) * self.world.page_size}] give"
                    )
        if self.session.ending is None:
            await self.call("release", load_id=reply["load_id"])
        return int(reply["tokens"])

    async def kill(self) -> None:
        """The engine dies: its connection is lost, its session ends (awaited)."""
        assert self.link is not None
        assert self.session is not None
        self.link.abort()
        assert self.session.ending is not None
        await self.session.ending

    async def _end(self, reason: str) -> None:
        assert self.session is not None
        if self._in_hand is not None:
            await asyncio.wait([self._in_hand])
        await self.world.server.end(self.session, reason)

    def close(self) -> None:
        for owned in (self.pools, self.counters):
            if owned is not None:
                owned.close()


# the worlds running now (in this process's loops): a drain's leak check skips the others'
_LIVE: list[SidecarWorld] = []


@dataclass
class SidecarWorld:
    server: EngineServer
    backend: InlineCopyBackend
    l3: MemoryBackend
    page_size: int
    engines: list[Engine] = field(default_factory=list)
    report: DrainReport | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def running(
        cls, config: Path, l3: MemoryBackend | None = None
    ) -> AsyncIterator[SidecarWorld]:
        """The server of the deployment at `config` (token groups only: what the engines
        write), its TaskGroup open for the block. `l3`: another world's L3, shared (two
        hosts' sidecars, one L3)."""
        loaded = load_deployment(config)
        plan = sidecar_plan(loaded)
        state_groups = [g.name for g in plan.layer_map.groups if not g.kind.is_token_cache]
        if state_groups:
            raise ValueError(
                f"{config}: groups {state_groups} hold state snapshots; the world's engines "
                "write token groups only: give a model without state caches"
            )
        backend = InlineCopyBackend()
        l3 = MemoryBackend() if l3 is None else l3
        world: SidecarWorld | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                server = EngineServer(plan, backend, GuardedStore(l3), tg, ServiceMetrics())
                world = cls(server, backend, l3, plan.page_size_tokens)
                _LIVE.append(world)
                try:
                    yield world
                finally:
                    try:
                        if world.report is None:
                            await world.drain()
                    finally:
                        _LIVE.remove(world)
        finally:
            for engine in world.engines if world is not None else []:
                engine.close()
            backend.close()

    def engine(self, name: str, **kwargs: Any) -> Engine:
        engine = Engine(self, name, **kwargs)
        self.engines.append(engine)
        return engine

    async def drain(self) -> DrainReport:
        """The server's drain (SIGTERM's); `NamespaceLeak` if a namespace task outlives it."""
        self.report = await self.server.drain()
        # another world running in this loop (two hosts' sidecars, `running(l3=...)`) keeps
        # its own namespaces' tasks
        others = {
            ns._task
            for world in _LIVE
            if world is not self
            for ns in world.server.namespaces.values()
        }
        left = [
            t
            for t in asyncio.all_tasks()
            if not t.done()
            and t not in others
            and t.get_name().startswith(("hicache-ns-", "hicache-start-"))
        ]
        if left:
            for task in left:
                task.cancel()
            raise NamespaceLeak(
                f"{len(left)} namespace task(s) still running after the drain: "
                + ", ".join(sorted(t.get_name() for t in left))
            )
        return self.report

    def check_settled(self) -> None:
        """One namespace per key; every live engine session attached to its key's namespace;
        no pin, reserved page, op or attachment that no live session holds."""
        server = self.server
        live = {s.id: s for s in server.sessions.values() if s.namespace is not None}
        for sid, session in live.items():
            assert session.key is not None
            recorded = server.namespaces.get(session.key)
            assert recorded is session.namespace, (
                f"session {sid} is attached to a namespace of {session.key} that is not the "
                f"key's recorded one (two namespaces of one key)"
            )
        for key, namespace in server.namespaces.items():
            stats = namespace_stats(namespace)
            mine = sorted(sid for sid, s in live.items() if s.key == key)
            assert stats["attached_sessions"] == mine, (
                f"namespace {key}: attached {stats['attached_sessions']}, live sessions {mine}"
            )
            for group, g in stats["groups"].items():
                for counter in ("pinned_pages", "host_pinned_pages", "reserved_pages"):
                    assert g[counter] == 0, f"namespace {key} group {group}: {counter} {g[counter]}"
            assert stats["in_flight_walks"] == 0, stats
            assert stats["queued_loads"] == 0, stats

    async def l3_missing(self, key: NamespaceKey, prompts: Sequence[Sequence[int]]) -> int:
        """How many full pages of `prompts` (every group) L3 lacks, by the namespace's keys."""
        namespace = self.server.namespaces[key]
        missing = 0
        for _group, keyer in namespace.cache.index.keyers.items():
            for tokens in prompts:
                keys = keyer.keys(tokens)
                present = await self.l3.exists_many(keys)
                missing += present.count(False)
        return missing
