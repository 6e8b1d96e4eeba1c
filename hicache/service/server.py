"""`EngineServer`: the sidecar's engine channel — sessions, validation, the ops, cleanup.

Lifecycle of a session: connect -> `hello` (version, token, layout and namespace checks) ->
`register_pools` (the engine's shared pool is mapped and attached to its namespace's cache; a
counter file is created for its loads) -> ops in order: lookup / store / load / prefetch /
release / stats / heartbeat -> the socket closes or heartbeats stop -> `_end_session` cancels
and awaits the session's loads (their pins go with them), detaches its pools and removes its
counter file; the namespace's L2 pages and index stay for the next engine.

A request that fails validation, names a page outside the pool, or hits any error gets an
error reply naming what is wrong; the connection and every other session carry on. Only an
oversized frame closes its connection (its bytes cannot be skipped safely).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from hicache.config import Deployment
from hicache.errors import HicacheError, ServiceStartError
from hicache.index import Hit
from hicache.memory import DevicePool, GroupGeometry, torch_dtype
from hicache.model import LayerMap
from hicache.scheduler import OpHandle, OpResult, OpState
from hicache.service import protocol as p
from hicache.service.metrics import ServiceMetrics
from hicache.service.namespaces import Namespace, NamespaceKey
from hicache.service.shm import CounterFile, LoadState, map_pools
from hicache.storage import GuardedStore
from hicache.transfer import CopyBackend

log = logging.getLogger("hicache.service")

_FINAL = {
    OpState.DONE: LoadState.DONE,
    OpState.FAILED: LoadState.FAILED,
    OpState.CANCELLED: LoadState.CANCELLED,
    OpState.EXPIRED: LoadState.FAILED,
}


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


class _Defer(Exception):
    """An inline handler found it must await after all (a lookup that L3 may extend)."""


Handler = Callable[[Session, Any], Coroutine[Any, Any, dict[str, Any]]]
InlineHandler = Callable[[Session, Any], dict[str, Any]]


class EngineServer:
    def __init__(
        self,
        deployment: Deployment,
        layer_map: LayerMap,
        backend: CopyBackend,
        store: GuardedStore | None,
        tg: asyncio.TaskGroup,
        metrics: ServiceMetrics,
    ):
        self.deployment = deployment
        self.service = deployment.service
        self.layer_map = layer_map
        self.backend = backend
        self.store = store
        self.metrics = metrics
        self._tg = tg
        dtype = torch_dtype(deployment.model.dtype)
        page = deployment.model.page_size_tokens
        self.geometries = {g.name: GroupGeometry(g, dtype, page) for g in layer_map.groups}
        self.layout = p.layout_summary(layer_map, deployment.model.dtype, page)
        self.namespaces: dict[NamespaceKey, Namespace] = {}
        self.sessions: dict[int, Session] = {}
        self._session_ids = itertools.count(1)
        self._load_ids = itertools.count(1)
        self._servers: list[asyncio.Server] = []
        self._connections: set[EngineConnection] = set()
        self._draining = False
        self._watchdog_task: asyncio.Task[None] | None = None
        self._handlers: dict[str, Handler] = {
            "hello": self._hello,
            "register_pools": self._register_pools,
            "register_cuda_pools": self._register_cuda_pools,
            "store": self._store,
            "load": self._load,
            "prefetch": self._prefetch,
            "lookup": self._lookup_discovering,  # when the inline lookup defers
        }
        self._inline: dict[str, InlineHandler] = {
            "lookup": self._lookup,
            "release": self._release,
            "stats": self._stats,
            "heartbeat": self._heartbeat,
        }

    # ---- listening ------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        path = self.service.socket_path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)
            old = os.umask(0o177)  # the socket is born 0600: no window where others may connect
            try:
                self._servers.append(await self._loop.create_unix_server(self._accept, str(path)))
            finally:
                os.umask(old)
        except OSError as exc:
            raise ServiceStartError(
                f"service.socket_path: cannot listen on {str(path)!r}: {exc.strerror or exc}"
            ) from exc
        if self.service.tcp_port is not None:
            where = f"{self.service.tcp_host}:{self.service.tcp_port}"
            try:
                self._servers.append(
                    await self._loop.create_server(
                        self._accept, self.service.tcp_host, self.service.tcp_port
                    )
                )
            except OSError as exc:
                raise ServiceStartError(
                    f"service.tcp_host/tcp_port: cannot listen on {where}: {exc.strerror or exc}"
                ) from exc
        self._watchdog_task = self._tg.create_task(
            self._watchdog(), name="hicache-heartbeat-watchdog"
        )
        log.info("engine channel listening", extra={"fields": {"socket": str(path)}})

    @property
    def listening(self) -> bool:
        return bool(self._servers) and all(s.is_serving() for s in self._servers)

    def set_store(self, store: GuardedStore | None) -> GuardedStore | None:
        """Attach or detach L3 at runtime (the admin API); returns the previous store."""
        old, self.store = self.store, store
        for namespace in self.namespaces.values():
            namespace.cache.attach_l3(store)
        return old

    @property
    def tcp_port(self) -> int | None:
        for server in self._servers[1:]:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return None

    def _accept(self) -> EngineConnection:
        return EngineConnection(self)

    def _open(self, connection: EngineConnection) -> Session | None:
        if self._draining or len(self.sessions) >= self.service.max_sessions:
            reason = "draining" if self._draining else f"{len(self.sessions)} sessions (max)"
            connection.transport.write(
                p.error(0, p.ErrorCode.BUSY, f"sidecar refuses connections: {reason}")
            )
            connection.transport.close()
            return None
        session = Session(next(self._session_ids), connection.transport, time.monotonic())
        self.sessions[session.id] = session
        self.metrics.sessions.set(len(self.sessions))
        return session

    def answer_now(self, session: Session, payload: bytes) -> bytes | None:
        """Answer a request inline when its op needs no await (lookup, heartbeat, stats,
        release — most of the small traffic); None: it must go through `answer`."""
        try:
            request_id, op, args = p.parse_request(payload)
        except p.RequestError as exc:
            self.metrics.errors.labels(exc.code).inc()
            return p.error(0, exc.code, exc.message)
        handler = self._inline.get(op)
        if handler is None or session.key is None:
            return None
        started = time.perf_counter()
        try:
            reply = p.ok(request_id, handler(session, args))
        except _Defer:
            return None
        except Exception as exc:
            reply = self._error_reply(session, request_id, op, exc)
        self.metrics.request(op, time.perf_counter() - started)
        return reply

    async def answer(self, session: Session, payload: bytes) -> bytes:
        request_id = 0
        op = "?"
        started = time.perf_counter()
        session.in_request += 1
        try:
            request_id, op, args = p.parse_request(payload)
            if session.key is None and op != "hello":
                raise p.RequestError(p.ErrorCode.NOT_READY, f"{op}: send hello first")
            handler = self._handlers.get(op)
            if handler is not None:
                result = await handler(session, args)
            else:
                result = self._inline[op](session, args)
            reply = p.ok(request_id, result)
        except Exception as exc:
            reply = self._error_reply(session, request_id, op, exc)
        finally:
            session.in_request -= 1
            session.last_seen = time.monotonic()
        self.metrics.request(op, time.perf_counter() - started)
        return reply

    def _error_reply(self, session: Session, request_id: int, op: str, exc: Exception) -> bytes:
        if isinstance(exc, p.RequestError):
            code, message = exc.code, exc.message
        elif isinstance(exc, HicacheError):
            code, message = p.ErrorCode.BAD_REQUEST, f"{op}: {exc}"
        else:  # the server stays up; the engine learns what happened
            log.exception("request failed", extra={"fields": {"op": op, "session": session.id}})
            code, message = p.ErrorCode.INTERNAL, f"{op}: {type(exc).__name__}: {exc}"
        self.metrics.errors.labels(code).inc()
        return p.error(request_id, code, message)

    # ---- ops ----------------------------------------------------------------------------------

    async def _hello(self, session: Session, args: p.Hello) -> dict[str, Any]:
        if session.key is not None:
            raise p.RequestError(p.ErrorCode.REFUSED, "hello: this session already said hello")
        if args.protocol != p.PROTOCOL_VERSION:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"hello.protocol: engine speaks version {args.protocol}; this sidecar speaks "
                f"{p.PROTOCOL_VERSION}",
            )
        secret = self.service.token
        if secret is not None and not hmac.compare_digest(
            (args.token or "").encode(), secret.get_secret_value().encode()
        ):
            raise p.RequestError(
                p.ErrorCode.REFUSED, "hello.token: missing or wrong (service.token is set)"
            )
        diffs = p.layout_differences(args.layout, self.layout)
        if diffs:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                "hello.layout: the engine's KV layout differs from the sidecar's model; "
                + "; ".join(diffs),
            )
        key = NamespaceKey(args.tp_rank, args.tenant)
        for other in self.sessions.values():
            if other.key == key:
                raise p.RequestError(
                    p.ErrorCode.REFUSED,
                    f"hello: namespace {key} is attached by {other.describe()}; one engine per "
                    "namespace (give each tensor-parallel rank its tp_rank)",
                )
        session.key, session.engine, session.pid = key, args.engine, args.pid
        return {
            "session": session.id,
            "protocol": p.PROTOCOL_VERSION,
            "heartbeat_timeout_s": self.service.heartbeat_timeout_s,
            "load_slots": self.service.load_slots,
            "shm_dir": str(self.service.shm_dir),
        }

    async def _register_pools(self, session: Session, args: p.RegisterPools) -> dict[str, Any]:
        """The CPU data plane: the engine's pool is a file in shared memory we map."""
        if self.deployment.device.kind != "cpu":
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                "register_pools: this sidecar copies on CUDA (device.kind: cuda); export the "
                "engine's CUDA pools with register_cuda_pools",
            )
        self._check_unregistered(session, "register_pools")
        try:
            pools = map_pools(args.model_dump(), self.geometries, self.service.shm_dir)
        except HicacheError as exc:
            raise p.RequestError(p.ErrorCode.BAD_REQUEST, f"register_pools.{exc}") from None
        reply = await self._attach(session, pools)
        session.pool_path = Path(args.path)
        return reply

    async def _register_cuda_pools(
        self, session: Session, args: p.RegisterCudaPools
    ) -> dict[str, Any]:
        """The CUDA data plane: the engine's pool tensors arrive as CUDA IPC handles."""
        if self.deployment.device.kind != "cuda":
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                "register_cuda_pools: this sidecar copies on CPU (device.kind: cpu); share the "
                "pool through shared memory with register_pools, or run the sidecar with "
                "device.kind: cuda",
            )
        self._check_unregistered(session, "register_cuda_pools")
        from hicache.transfer.cuda_ipc import map_cuda_pools  # CUDA only when used

        try:
            pools = map_cuda_pools(args.model_dump(), self.geometries)
        except HicacheError as exc:
            raise p.RequestError(p.ErrorCode.BAD_REQUEST, f"register_cuda_pools.{exc}") from None
        return await self._attach(session, pools)

    def _check_unregistered(self, session: Session, op: str) -> None:
        if session.pools is not None:
            raise p.RequestError(p.ErrorCode.REFUSED, f"{op}: pools already registered")

    async def _attach(self, session: Session, pools: dict[str, DevicePool]) -> dict[str, Any]:
        assert session.key is not None
        counters = CounterFile.create(self.service.shm_dir, self.service.load_slots)
        try:
            namespace = self.namespaces.get(session.key)
            if namespace is None:
                namespace = await Namespace.start(
                    session.key,
                    self.deployment,
                    self.layer_map,
                    self.backend,
                    self.store,
                    pools,
                    self._tg,
                )
                self.namespaces[session.key] = namespace
            namespace.attach(session.id, pools)
        except BaseException:
            counters.unlink()
            raise
        session.namespace, session.pools, session.counters = namespace, pools, counters
        session.free_slots = list(range(self.service.load_slots - 1, -1, -1))
        return {"counters": str(counters.path), "slots": counters.slots}

    def _ready(self, session: Session, op: str) -> Namespace:
        if session.namespace is None:
            raise p.RequestError(p.ErrorCode.NOT_READY, f"{op}: send register_pools first")
        return session.namespace

    def _check_pages(self, session: Session, op: str, device_pages: dict[str, list[int]]) -> None:
        assert session.pools is not None
        for group, pages in device_pages.items():
            pool = session.pools.get(group)
            if pool is None:
                raise p.RequestError(
                    p.ErrorCode.BAD_REQUEST,
                    f"{op}.device_pages: group {group!r} is not in the layout; groups: "
                    f"{', '.join(sorted(session.pools))}",
                )
            bad = [page for page in pages if page >= pool.num_pages]
            if bad:
                raise p.RequestError(
                    p.ErrorCode.OUT_OF_RANGE,
                    f"{op}.device_pages.{group}: pages {bad[:5]} are outside the registered "
                    f"pool of {pool.num_pages} pages (0..{pool.num_pages - 1})",
                )
        missing = set(session.pools) - set(device_pages)
        if missing:
            raise p.RequestError(
                p.ErrorCode.BAD_REQUEST,
                f"{op}.device_pages: groups {sorted(missing)} missing; every group of the "
                "layout needs its pages",
            )

    def _lookup(self, session: Session, args: p.Tokens) -> dict[str, Any]:
        cache = self._ready(session, "lookup").cache
        hit = cache.lookup(args.tokens)
        if cache.needs_discovery(args.tokens, hit):
            raise _Defer  # ask L3 first: the async path (`_lookup_discovering`)
        return self._lookup_reply(hit, len(args.tokens))

    async def _lookup_discovering(self, session: Session, args: p.Tokens) -> dict[str, Any]:
        cache = self._ready(session, "lookup").cache
        await cache.discover(args.tokens)
        return self._lookup_reply(cache.lookup(args.tokens), len(args.tokens))

    def _lookup_reply(self, hit: Hit, asked: int) -> dict[str, Any]:
        self.metrics.lookup(hit.tokens_l2, hit.tokens_total, asked)
        return {
            "page_size_tokens": hit.page_size_tokens,
            "tokens_l2": hit.tokens_l2,
            "tokens_total": hit.tokens_total,
        }

    async def _store(self, session: Session, args: p.PagesRequest) -> dict[str, Any]:
        namespace = self._ready(session, "store")
        self._check_pages(session, "store", args.device_pages)
        result = await namespace.cache.store(args.tokens, args.device_pages)
        self.metrics.evictions.inc(result.pages_evicted)
        if result.bytes_backed_up:
            self.metrics.moved("backup", result.bytes_backed_up, result.backup_seconds)
        return asdict(result)

    async def _prefetch(self, session: Session, args: p.Tokens) -> dict[str, Any]:
        pages = await self._ready(session, "prefetch").cache.prefetch(args.tokens)
        return {"pages_fetched": pages}

    async def _load(self, session: Session, args: p.LoadRequest) -> dict[str, Any]:
        namespace = self._ready(session, "load")
        self._check_pages(session, "load", args.device_pages)
        counters = session.counters
        assert counters is not None
        if not session.free_slots:
            raise p.RequestError(
                p.ErrorCode.BUSY,
                f"load: all {counters.slots} load slots hold unreleased loads; release "
                "finished loads (LoadHandle.done() does) or raise service.load_slots",
            )
        slot = session.free_slots.pop()
        load_id = next(self._load_ids)
        num_layers = len(self.layer_map.stage_layer_ids)
        counters.start(slot, load_id, num_layers)
        row = counters.array[slot]

        def on_layer(upto: int) -> None:  # the copy thread, as each layer lands
            row[4] = time.monotonic_ns()
            row[1] = upto

        try:
            handle, hit = await namespace.cache.load(
                args.tokens, args.device_pages, on_layer=on_layer, skip_pages=args.skip_pages
            )
        except BaseException:
            row[2] = LoadState.FREE
            session.free_slots.append(slot)
            raise
        failed = {group: list(positions) for group, positions in hit.failed.items()}
        if handle is None:
            row[2] = LoadState.FREE
            session.free_slots.append(slot)
            return {"load_id": None, "tokens": 0, "failed": failed}
        entry = LoadEntry(slot, handle)
        session.loads[load_id] = entry

        def finished(result: OpResult) -> None:
            row[2] = _FINAL.get(result.state, LoadState.FAILED)
            self.metrics.moved("load", result.bytes_moved, result.seconds)
            if entry.released:
                self._free(session, load_id)

        handle.add_done_callback(finished)
        return {
            "load_id": load_id,
            "slot": slot,
            "tokens": hit.tokens_total,
            "num_layers": num_layers,
            "failed": failed,
        }

    def _free(self, session: Session, load_id: int) -> None:
        entry = session.loads.pop(load_id, None)
        if entry is not None and session.counters is not None:
            session.counters.array[entry.slot][2] = LoadState.FREE
            session.free_slots.append(entry.slot)

    def _release(self, session: Session, args: p.Release) -> dict[str, Any]:
        self._ready(session, "release")
        entry = session.loads.get(args.load_id)
        if entry is None:
            raise p.RequestError(
                p.ErrorCode.OUT_OF_RANGE,
                f"release.load_id: {args.load_id} is not a load of this session in flight or "
                "unreleased",
            )
        entry.released = True
        if entry.handle.result is None:
            entry.handle.cancel()  # the engine gave up on it; pins go when it ends
            return {"state": "cancelling"}
        self._free(session, args.load_id)
        return {"state": "released"}

    def _stats(self, session: Session, args: p.Empty) -> dict[str, Any]:
        namespace = self._ready(session, "stats")
        return {**namespace_stats(namespace), "l3": store_stats(self.store)}

    def _heartbeat(self, session: Session, args: p.Heartbeat) -> dict[str, Any]:
        for stall in args.layer_stall_s:
            self.metrics.layer_stall.observe(stall)
        return {"now": time.time()}

    # ---- session end --------------------------------------------------------------------------

    async def _end_session(self, session: Session, reason: str) -> None:
        running = [e.handle for e in session.loads.values() if e.handle.result is None]
        for handle in running:
            handle.cancel()
        if running:
            await asyncio.gather(*(h.done() for h in running))
        namespace = session.namespace
        if namespace is not None and namespace.owner == session.id:
            namespace.detach()
        if session.counters is not None:
            session.counters.unlink()
        session.loads.clear()
        session.pools = None
        if session.pool_path is not None and session.pid:
            self._tg.create_task(self._reap_pool_file(session.pid, session.pool_path))
        self.sessions.pop(session.id, None)
        self.metrics.sessions.set(len(self.sessions))
        with contextlib.suppress(Exception):
            session.transport.close()
        log.info(
            "session ended",
            extra={
                "fields": {
                    "session": session.id,
                    "reason": reason,
                    "loads_cancelled": len(running),
                }
            },
        )

    async def _reap_pool_file(self, pid: int, path: Path, wait_s: float = 5.0) -> None:
        """An engine that dies leaves its pool file in shared memory; once its process is gone
        (its socket closes a moment before it exits), remove the file. A live engine that
        merely disconnected keeps it: it re-registers the same file on reconnect."""
        deadline = time.monotonic() + wait_s
        while _alive(pid):
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.05)
        _remove_under(path, self.service.shm_dir)

    async def _watchdog(self) -> None:
        timeout = self.service.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(timeout / 4, 1.0))
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if not session.in_request and now - session.last_seen > timeout:
                    log.warning(
                        "engine missed heartbeats",
                        extra={"fields": {"session": session.id, "timeout_s": timeout}},
                    )
                    session.transport.abort()  # connection_lost ends the session

    # ---- drain ----------------------------------------------------------------------------------

    async def drain(self) -> DrainReport:
        """Stop listening; let in-flight loads finish within service.drain_timeout_s (then
        cancel them); close sessions; persist what the write policy owes to L3."""
        self._draining = True
        for server in self._servers:
            server.close()
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
        handles = [e.handle for s in self.sessions.values() for e in s.loads.values()]
        pending = [h for h in handles if h.result is None]
        cancelled = 0
        if pending:
            _done, late = await asyncio.wait(
                [asyncio.ensure_future(h.done()) for h in pending],
                timeout=self.service.drain_timeout_s,
            )
            for handle in pending:
                if handle.result is None:
                    handle.cancel()
                    cancelled += 1
            if late:
                await asyncio.gather(*late)
        for session in list(self.sessions.values()):
            session.transport.abort()
        ending = [c.ended for c in self._connections if c.ended is not None]
        if ending:
            await asyncio.gather(*ending, return_exceptions=True)
        flushed = 0
        for namespace in self.namespaces.values():
            flushed += await namespace.cache.flush()
            await namespace.close()
        with contextlib.suppress(OSError):
            self.service.socket_path.unlink()
        return DrainReport(len(pending) - cancelled, cancelled, flushed)


def namespace_stats(namespace: Namespace) -> dict[str, Any]:
    cache = namespace.cache
    sched = cache.embedded.scheduler.stats()
    groups = {}
    for group in cache.index.rules:
        pool = cache.embedded.host_tier.pool(group)
        groups[group] = {
            "l2_pages": cache.index.l2_pages(group),
            "l2_capacity_pages": pool.num_pages,
            "pinned_pages": cache.index.pinned_pages(group),
            "l3_pages_known": cache.index.l3_pages(group),
        }
    return {
        "namespace": str(namespace.key),
        "attached_session": namespace.owner,
        "groups": groups,
        "queued_loads": sched.queued_loads,
        "queued_backups": sched.queued_backups,
        "in_flight_bytes": sched.in_flight_bytes,
        "in_flight_walks": sched.in_flight_walks,
        "ops_by_state": dict(sched.ops_by_state),
        "load": asdict(sched.load),
        "backup": asdict(sched.backup),
    }


def store_stats(store: GuardedStore | None) -> dict[str, Any] | None:
    if store is None:
        return None
    s = store.stats
    return {
        "breaker": store.breaker.state.value,
        "puts": s.puts,
        "stored": s.stored,
        "gets": s.gets,
        "hits": s.hits,
        "misses": s.misses,
        "corrupt_dropped": s.corrupt_dropped,
        "skipped_open": s.skipped_open,
        "put_bytes": s.put_bytes,
        "put_seconds": s.put_seconds,
        "get_bytes": s.get_bytes,
        "get_seconds": s.get_seconds,
        "failures": dict(s.failures),
    }


def _alive(pid: int) -> bool:
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


class EngineConnection(asyncio.Protocol):
    """One engine connection: frames in, replies out, in request order. Cheap ops are answered
    inside `data_received` (no task, no await); the first op that must await starts a worker
    task that drains the queue in order, so a later cheap op never overtakes it."""

    def __init__(self, server: EngineServer):
        self.server = server
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.session: Session | None = None
        self.buffer = bytearray()
        self.queue: deque[bytes] = deque()
        self.worker: asyncio.Task[None] | None = None
        self.ended: asyncio.Task[None] | None = None
        self.reason = "closed by engine"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.session = self.server._open(self)
        if self.session is not None:
            self.server._connections.add(self)

    def data_received(self, data: bytes) -> None:
        session = self.session
        if session is None or self.transport.is_closing():
            return
        session.last_seen = time.monotonic()
        buffer = self.buffer
        buffer += data
        header = p.HEADER.size
        limit = self.server.service.max_frame_bytes
        while len(buffer) >= header:
            (size,) = p.HEADER.unpack_from(buffer)
            if size > limit:
                self.transport.write(
                    p.error(
                        0,
                        p.ErrorCode.BAD_FRAME,
                        f"frame of {size} bytes exceeds service.max_frame_bytes ({limit}); "
                        "closing the connection",
                    )
                )
                self.server.metrics.errors.labels(p.ErrorCode.BAD_FRAME).inc()
                self.reason = "oversized frame"
                self.transport.close()
                return
            if len(buffer) < header + size:
                break
            payload = bytes(buffer[header : header + size])
            del buffer[: header + size]
            if self.worker is None:
                reply = self.server.answer_now(session, payload)
                if reply is not None:
                    self.transport.write(reply)
                    continue
            self.queue.append(payload)
            if self.worker is None:
                self.worker = asyncio.ensure_future(self._drain(session))

    async def _drain(self, session: Session) -> None:
        try:
            while self.queue:
                reply = await self.server.answer(session, self.queue.popleft())
                if not self.transport.is_closing():
                    self.transport.write(reply)
        finally:
            self.worker = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.session is None:
            return
        if exc is not None and self.reason == "closed by engine":
            self.reason = "connection lost"
        self.ended = asyncio.ensure_future(self._end())

    async def _end(self) -> None:
        assert self.session is not None
        if self.worker is not None:  # let the op in hand finish before its pools go away
            await asyncio.gather(self.worker, return_exceptions=True)
        self.queue.clear()
        try:
            await self.server._end_session(self.session, self.reason)
        finally:
            self.server._connections.discard(self)


def _remove_under(path: Path, root: Path) -> None:
    with contextlib.suppress(OSError):
        if path.resolve().is_relative_to(root.resolve()):
            path.unlink()
