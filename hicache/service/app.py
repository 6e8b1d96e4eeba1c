"""`hicache serve`: the long-running sidecar process.

Lifecycle: load the deployment -> check what needs the layout (the L2 budget holds a page of
every group) -> copy backend and L3 store -> one TaskGroup owns the engine server (and, per
engine namespace, a scheduler task), the HTTP control API and the L3 probe -> print one
`ready` line (socket, HTTP port) -> run until SIGTERM or SIGINT -> drain, all of it within
`service.drain_timeout_s`: stop listening, let in-flight loads finish (cancel those still
running at the deadline), close sessions, flush what the write policy owes to L3 in the time
left (what is still unwritten at the deadline is counted, not written) -> the KV-event
publisher (`service.kv_events`, bound before the engine channel opens) sends what is queued
and stops -> the `stopped` line
(loads finished and cancelled, pages flushed, pages and bytes unflushed) -> close the store and
the backend -> exit 0.

A failure before `ready` closes what was started so far (listeners, store, backend and its
worker thread) and reaches the CLI as one `HicacheError` naming the key at fault — a
`ServiceStartError` when the cause was a backend's own error (an `OSError` creating the L3
directory, an unusable URL) — which prints it on one line and exits 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import Callable

from aiohttp import web

from hicache.assembly import copy_backend, host_pages, open_store, starting
from hicache.assembly.sidecar import sidecar_plan
from hicache.assembly.stores import cause
from hicache.config import LoadedConfig
from hicache.errors import HicacheError, ServiceStartError
from hicache.service.http_api import start_http
from hicache.service.kv_events import KvEvents, start_kv_events
from hicache.service.logs import configure
from hicache.service.metrics import ServiceMetrics
from hicache.service.server import EngineServer
from hicache.storage import GuardedStore
from hicache.storage.breaker import PROBE_INTERVAL_S
from hicache.transfer import CopyBackend

log = logging.getLogger("hicache.service")


async def _probe_l3(server: EngineServer) -> None:
    """Probe L3 while its breaker is open (`GuardedStore.probe`), every `PROBE_INTERVAL_S`
    (at most half of `reset_after_s`): hits are back within an interval and a call of the
    outage's end."""
    while True:
        store = server.store
        every = PROBE_INTERVAL_S
        if store is not None:
            every = min(PROBE_INTERVAL_S, max(0.1, store.breaker.reset_after_s / 2))
        await asyncio.sleep(every)
        if server.store is not None:
            await server.store.probe()


def _first_hicache_error(group: BaseExceptionGroup[BaseException]) -> HicacheError | None:
    for exc in group.exceptions:
        if isinstance(exc, HicacheError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first_hicache_error(exc)
            if found is not None:
                return found
    return None


async def serve(
    loaded: LoadedConfig,
    stop: asyncio.Event | None = None,
    *,
    backend_factory: Callable[[LoadedConfig], CopyBackend] | None = None,
) -> int:
    """Run the sidecar until `stop` (or SIGTERM / SIGINT); the exit code. `backend_factory`:
    builds the copy backend instead of `device.kind`'s (a harness's, `hicache.testing.serve`);
    serve owns and closes what it returns."""
    plan = sidecar_plan(loaded)  # the layout, the model name, what the service reads
    service = plan.service
    configure(service.log_format)
    layer_map = plan.layer_map
    host_pages(loaded, layer_map)  # an L2 too small for one page: refused before anything starts
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    backend: CopyBackend | None = None
    store: GuardedStore | None = None
    server: EngineServer | None = None
    runner: web.AppRunner | None = None
    kv_events: KvEvents | None = None
    ready = False
    try:
        with starting(loaded, "device.kind", f"cannot start the {plan.device_kind} copy backend"):
            if backend_factory is not None:
                backend = backend_factory(loaded)
            else:
                backend = copy_backend(loaded.deployment)
        store = open_store(loaded)
        metrics = ServiceMetrics()
        metrics.page_size_tokens = plan.page_size_tokens
        async with asyncio.TaskGroup() as tg:
            server = EngineServer(plan, backend, store, tg, metrics)
            if service.kv_events is not None:  # bound before engines come: no store unseen
                kv_events = start_kv_events(service.kv_events, plan.page_size_tokens)
                server.state.kv_events = kv_events
                metrics.kv_events = kv_events.counts
            metrics.watch(lambda: list(server.namespaces.values()), lambda: server.store)
            http_port = None
            if service.http_port is not None:  # first: it logs nothing if the rest fails
                runner, http_port = await start_http(
                    server, metrics, service.http_host, service.http_port
                )
            await server.start()
            probe = tg.create_task(_probe_l3(server), name="hicache-l3-probe")
            fields = {
                "socket": str(service.socket_path),
                "tcp_port": server.tcp_port,
                "http_port": http_port,
                "model": layer_map.model_type,
                "model_name": server.model_name,
                "l3": plan.storage_kind,
                "kv_events": None if kv_events is None else kv_events.publisher.endpoint,
            }
            gc.freeze()  # start-up objects (torch's among them) leave the collector's scans
            row_kernel = getattr(backend, "row_kernel", None)  # CPU: native C or numpy (why)
            log.info("serving", extra={"fields": {**fields, "row_kernel": row_kernel}})
            ready = True
            print(
                "hicache serve: ready "
                + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None),
                flush=True,
            )
            await stop.wait()
            log.info(
                "draining",
                extra={
                    "fields": {
                        "sessions": len(server.sessions),
                        "drain_timeout_s": service.drain_timeout_s,
                    }
                },
            )
            report = await server.drain()
            probe.cancel()
            if runner is not None:
                await runner.cleanup()
        log.info(
            "stopped",
            extra={
                "fields": {
                    "loads_finished": report.loads_finished,
                    "loads_cancelled": report.loads_cancelled,
                    "pages_flushed": report.pages_flushed,
                    "pages_unflushed": report.pages_unflushed,
                    "bytes_unflushed": report.bytes_unflushed,
                }
            },
        )
    except BaseExceptionGroup as group:
        # the TaskGroup wraps what its body raised: a start-up error reaches the CLI as itself
        if server is not None and server.listening:
            with contextlib.suppress(OSError):
                service.socket_path.unlink()  # no socket left behind that nobody serves
        first = _first_hicache_error(group)
        if first is not None:
            raise first from None
        if ready:
            raise
        raise ServiceStartError(
            f"{loaded.path}: start-up failed: {cause(group.exceptions[0])}"
        ) from group
    finally:
        if server is not None and not ready:
            await _close_listeners(server, runner, service.drain_timeout_s)
        if kv_events is not None:  # what the drain published goes out, then the thread ends
            kv_events.close()
        live = server.store if server is not None else store
        if live is not None:
            with contextlib.suppress(Exception):
                await live.backend.close()
        if backend is not None:
            backend.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        sys.stdout.flush()
    return 0


async def _close_listeners(
    server: EngineServer, runner: web.AppRunner | None, timeout_s: float
) -> None:
    """After a failed start: stop the listeners that did start and remove the socket (no
    engine is attached yet, so the drain has nothing else to do)."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout_s):
            await server.drain()
            if runner is not None:
                await runner.cleanup()
