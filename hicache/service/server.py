"""`EngineServer`: the sidecar's engine channel — listening, sessions, dispatch of each request
to its op's handler, cleanup, the drain. It builds the explicit `ServerState` once and the op
classes over it (`ops_session`, `ops_pools`, `ops_lookup`, `ops_data`), and is the
`Dispatcher` (dispatch.py) its connections talk to.

Lifecycle of a session: connect -> `hello` (version, token, layout and namespace checks) ->
`register_pools` (the engine's sealed memfds — its pool and its load counters — are taken from
the socket's peer process and mapped; the pool is attached to its namespace's cache) -> ops in
order: lookup (by tokens; by page keys, `lookup_keys`; several, `lookup_many`) / store / load /
prefetch / release / stats / heartbeat -> the socket closes or
heartbeats stop -> the request in hand is awaited (connection.py) -> `end` cancels and
awaits the session's loads (their pins go with them), detaches its pools (its stores' backups
and every other op of its attachment cancelled and awaited), and only then releases its claim
on the engine's memory (`Session.ended`: a new session of the same engine may now register
it, `claims.py`) and drops every mapping of it; the namespace's L2
pages and index stay for the other engines attached and the next ones. Many engine sessions
may share a namespace: each one's end touches only its own loads, pins and pools.

A request that fails validation, names a page outside the pool, or hits any error gets an
error reply naming what is wrong; the connection and every other session carry on. Only an
oversized frame closes its connection (its bytes cannot be skipped safely). Sessions log their
start and end; a refused hello or pool registration logs its reason once (`_refused`; never
the token).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import time
from pathlib import Path

from hicache.assembly import ServiceSettings
from hicache.assembly.sidecar import SidecarPlan
from hicache.channel import protocol as p
from hicache.errors import HicacheError, PoolExhaustedError, ServiceStartError
from hicache.service.checkpoints import checkpoint
from hicache.service.connection import EngineConnection
from hicache.service.dispatch import (
    ConnectionLimits,
    Deferred,
    Handler,
    Later,
    Reply,
    awaited,
)
from hicache.service.metrics import ServiceMetrics
from hicache.service.namespaces import Namespace, NamespaceKey
from hicache.service.ops_data import DataOps
from hicache.service.ops_lookup import LookupOps
from hicache.service.ops_pools import PoolOps
from hicache.service.ops_session import SessionOps
from hicache.service.sessions import DrainReport, Session, process_start
from hicache.service.state import ServerState
from hicache.storage import GuardedStore
from hicache.transfer import CopyBackend

log = logging.getLogger("hicache.service")
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SETUP_OPS = frozenset({"hello", "register_pools", "register_cuda_pools"})


def _answers(path: Path) -> bool:
    """Something accepts connections on the Unix socket `path` (a live server)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def name_peer(session: Session, transport: asyncio.BaseTransport) -> None:
    """The Unix socket's peer as the kernel names it (SO_PEERCRED: its pid when it connected,
    0 when it is outside our pid namespace) and that process's start time; nothing for TCP."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return
    session.unix = True
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, _uid, _gid = _PEERCRED.unpack(raw)
    if pid > 0:
        session.peer_pid, session.peer_start = int(pid), process_start(int(pid))


class EngineServer:
    def __init__(
        self,
        plan: SidecarPlan,
        backend: CopyBackend,
        store: GuardedStore | None,
        tg: asyncio.TaskGroup,
        metrics: ServiceMetrics,
    ):
        self.state = ServerState.build(plan, backend, store, tg, metrics)
        self.metrics = metrics
        self._limits = ConnectionLimits.of(plan.service)
        self._servers: list[asyncio.Server] = []
        self._draining = False
        self._bound = False  # the socket file is ours to remove
        self._watchdog_task: asyncio.Task[None] | None = None
        hello, pools = SessionOps(self.state), PoolOps(self.state)
        lookups, data = LookupOps(self.state), DataOps(self.state)
        # one handler per op: its result now, or a `Later` to await (dispatch.py)
        self._handlers: dict[str, Handler] = {
            "hello": awaited(hello.hello),
            "register_pools": awaited(pools.register_pools),
            "register_cuda_pools": awaited(pools.register_cuda_pools),
            "lookup": lookups.lookup,
            "lookup_keys": lookups.lookup_keys,
            "lookup_many": lookups.lookup_many,
            "store": awaited(data.store),
            "load": awaited(data.load),
            "store_keys": awaited(data.store_keys),
            "load_keys": awaited(data.load_keys),
            "prefetch": awaited(data.prefetch),
            "release": data.release,
            "stats": hello.stats,
            "heartbeat": hello.heartbeat,
        }

    # what the control API and the app read
    @property
    def plan(self) -> SidecarPlan:
        return self.state.plan

    @property
    def service(self) -> ServiceSettings:
        return self.state.service

    @property
    def model_name(self) -> str:
        return self.state.model_name

    @property
    def backend(self) -> CopyBackend:
        return self.state.backend

    @property
    def store(self) -> GuardedStore | None:
        return self.state.store

    @property
    def namespaces(self) -> dict[NamespaceKey, Namespace]:
        return self.state.namespaces

    @property
    def sessions(self) -> dict[int, Session]:
        return self.state.sessions

    # ---- listening ------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        path = self.service.socket_path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if _answers(path):
                raise ServiceStartError(
                    f"service.socket_path: another hicache serve is listening on {str(path)!r}; "
                    "stop it, or give this one another socket_path"
                )
            path.unlink(missing_ok=True)  # a dead server's leftover
            old = os.umask(0o177)  # the socket is born 0600: no window where others may connect
            try:
                self._servers.append(await self._loop.create_unix_server(self._accept, str(path)))
            finally:
                os.umask(old)
            self._bound = True
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
        self._watchdog_task = self.state.tg.create_task(
            self._watchdog(), name="hicache-heartbeat-watchdog"
        )
        log.info("engine channel listening", extra={"fields": {"socket": str(path)}})

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def listening(self) -> bool:
        return bool(self._servers) and all(s.is_serving() for s in self._servers)

    def set_store(self, store: GuardedStore | None) -> GuardedStore | None:
        """Attach or detach L3 at runtime (the admin API); returns the previous store."""
        old, self.state.store = self.state.store, store
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

    # ---- the Dispatcher its connections talk to (dispatch.py) -----------------------------------

    @property
    def limits(self) -> ConnectionLimits:
        return self._limits

    def open(self, transport: asyncio.Transport) -> Session | None:
        if self._draining or len(self.sessions) >= self.service.max_sessions:
            reason = "draining" if self._draining else f"{len(self.sessions)} sessions (max)"
            log.warning("connection refused", extra={"fields": {"reason": reason}})
            transport.write(p.error(0, p.ErrorCode.BUSY, f"sidecar refuses connections: {reason}"))
            transport.close()
            return None
        session = Session(next(self.state.session_ids), transport, time.monotonic())
        name_peer(session, transport)
        self.sessions[session.id] = session
        self.metrics.sessions.set(len(self.sessions))
        return session

    def dropped(self, reason: str, *, error_code: str | None = None) -> None:
        if error_code is not None:
            self.metrics.errors.labels(error_code).inc()
        self.metrics.connections_dropped.labels(reason).inc()

    def _call(self, session: Session, op: str, args: object) -> Reply:
        if session.key is None and op != "hello":
            raise p.RequestError(p.ErrorCode.NOT_READY, f"{op}: send hello first")
        return self._handlers[op](session, args)

    def answer_now(self, session: Session, payload: bytes) -> bytes | Deferred:
        """Answer a request inline when its op needs no await (a lookup L3 cannot extend,
        heartbeat, stats, release — most of the small traffic); else what to await for it."""
        started = time.perf_counter()
        try:
            request_id, op, args = p.parse_request(payload)
        except p.RequestError as exc:
            self.metrics.errors.labels(exc.code).inc()
            self._refused(session, "?", exc.code, exc.message)
            return p.error(0, exc.code, exc.message)
        try:
            result = self._call(session, op, args)
            if isinstance(result, Later):
                return lambda: self._finish(session, request_id, op, result, started)
            reply = p.ok(request_id, result)
        except Exception as exc:
            reply = self._error_reply(session, request_id, op, exc)
        self.metrics.request(op, time.perf_counter() - started)
        return reply

    async def _finish(
        self, session: Session, request_id: int, op: str, later: Later, started: float
    ) -> bytes:
        """The reply to an op `answer_now` found must await."""
        session.in_request += 1
        try:
            reply = p.ok(request_id, await later.run())
        except Exception as exc:
            reply = self._error_reply(session, request_id, op, exc)
        finally:
            session.in_request -= 1
            session.last_seen = time.monotonic()
        self.metrics.request(op, time.perf_counter() - started)
        return reply

    async def answer(self, session: Session, payload: bytes) -> bytes:
        request_id = 0
        op = "?"
        started = time.perf_counter()
        session.in_request += 1
        try:
            request_id, op, args = p.parse_request(payload)
            result: Reply = self._call(session, op, args)
            if isinstance(result, Later):
                result = await result.run()
            reply = p.ok(request_id, result)
        except Exception as exc:
            reply = self._error_reply(session, request_id, op, exc)
        finally:
            session.in_request -= 1
            session.last_seen = time.monotonic()
        self.metrics.request(op, time.perf_counter() - started)
        return reply

    def _refused(self, session: Session, op: str, code: str, message: str) -> None:
        """One log line per refusal of a session's setup (hello, pool registration, anything
        before hello) or per REFUSED reply: the reason as the engine reads it, the token
        never (a reason that would quote it has it masked)."""
        if not (session.key is None or op in _SETUP_OPS or code == p.ErrorCode.REFUSED):
            return
        secret = self.service.token
        if secret is not None and secret.get_secret_value():
            message = message.replace(secret.get_secret_value(), "***")
        log.warning(
            "refused",
            extra={
                "fields": {
                    "session": session.id,
                    "pid": session.peer_pid or session.pid or None,
                    "op": op,
                    "code": code,
                    "reason": message[:500],
                }
            },
        )

    def _error_reply(self, session: Session, request_id: int, op: str, exc: Exception) -> bytes:
        if isinstance(exc, p.RequestError):
            code, message = exc.code, exc.message
        elif isinstance(exc, PoolExhaustedError):  # pages pinned by ops in flight: transient
            code = p.ErrorCode.BUSY
            message = (
                f"{op}: no free L2 page now ({exc}); the rest are pinned by copies in flight: "
                "retry after they end (if this persists, raise host.capacity_bytes)"
            )
        elif isinstance(exc, HicacheError):
            code, message = p.ErrorCode.BAD_REQUEST, f"{op}: {exc}"
        else:  # the server stays up; the engine learns what happened
            log.exception("request failed", extra={"fields": {"op": op, "session": session.id}})
            code, message = p.ErrorCode.INTERNAL, f"{op}: {type(exc).__name__}: {exc}"
        if code != p.ErrorCode.INTERNAL and session is not None:  # INTERNAL: logged above
            self._refused(session, op, code, message)
        self.metrics.errors.labels(code).inc()
        return p.error(request_id, code, message)

    async def end(self, session: Session, reason: str) -> None:
        await checkpoint("end.begin")
        running = [e.handle for e in session.loads.values() if e.handle.result is None]
        for handle in running:
            handle.cancel()
        if running:
            await asyncio.gather(*(h.done() for h in running))
        if session.prefault is not None:  # no thread touches its mapping once it is dropped
            await session.prefault.stop()
        namespace = session.namespace
        if namespace is not None:  # its own pools only: other engines' ops go on
            await checkpoint("end.detach")
            await namespace.detach(session.id)
        session.loads.clear()
        # every op of the session has settled (its request in hand awaited by the
        # connection, its loads and its attachment's ops cancelled and awaited above): no
        # copy touches the engine's memory any more, so another session may claim it
        # (claims.py). The last references to it go: a dead engine's memfd is freed now.
        session.pools = session.counters = session.namespace = None
        session.memory = []
        session.ended.set()
        self.sessions.pop(session.id, None)
        self.metrics.sessions.set(len(self.sessions))
        with contextlib.suppress(Exception):
            session.transport.close()
        log.info(
            "session ended",
            extra={
                "fields": {
                    "session": session.id,
                    "pid": session.peer_pid or session.pid or None,
                    "tp_rank": session.key.tp_rank if session.key is not None else None,
                    "tenant": session.key.tenant if session.key is not None else None,
                    "reason": reason,
                    "loads_cancelled": len(running),
                }
            },
        )

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
        """Stop listening and refuse new registrations (those waiting for a namespace's start
        too); within `service.drain_timeout_s` for the whole drain: in-flight loads finish
        (those still running at the deadline are cancelled), sessions close, then every
        namespace ever started — one still starting included — flushes what the write policy
        owes to L3 in the time left and stops its scheduler (`NamespaceRegistry.close_all`);
        pages L3 still lacks at the deadline are counted in the report, not written, and a
        start or scheduler still running then is cancelled, so the drain always ends."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.service.drain_timeout_s
        self._draining = True
        self.state.registry.begin_drain()
        self.state.store_waits.stop()  # lookups waiting for a store answer now
        for server in self._servers:
            server.close()
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
        await checkpoint("drain.begin")
        handles = [e.handle for s in self.sessions.values() for e in s.loads.values()]
        pending = [h for h in handles if h.result is None]
        cancelled = 0
        if pending:
            _done, late = await asyncio.wait(
                [asyncio.ensure_future(h.done()) for h in pending],
                timeout=max(0.0, deadline - loop.time()),
            )
            for handle in pending:
                if handle.result is None:
                    handle.cancel()
                    cancelled += 1
            if late:
                await asyncio.gather(*late)
        await checkpoint("drain.sessions")
        for session in list(self.sessions.values()):
            session.transport.abort()
        ending = [s.ending for s in self.sessions.values() if s.ending is not None]
        if ending:  # a session whose op outlives the deadline is left to end by itself
            done, _late = await asyncio.wait(ending, timeout=max(0.0, deadline - loop.time()))
            for task in done:
                if not task.cancelled():
                    task.exception()  # logged by the session's end; retrieved here
        # every session ended, and with it its prefault: nothing is queued on the thread
        self.state.prefaults.shutdown(wait=False, cancel_futures=True)
        await checkpoint("drain.flush")
        flushed = await self.state.registry.close_all(deadline)
        if flushed.unsettled:
            log.warning(
                "drain deadline passed",
                extra={"fields": {"cancelled": ", ".join(flushed.unsettled)}},
            )
        if self._bound:  # never another server's socket (a second serve that failed to start)
            with contextlib.suppress(OSError):
                self.service.socket_path.unlink()
        return DrainReport(
            len(pending) - cancelled,
            cancelled,
            flushed.written,
            flushed.left_pages,
            flushed.left_bytes,
        )
