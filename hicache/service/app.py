"""`hicache serve`: the long-running sidecar process.

Lifecycle: load the deployment -> copy backend and L3 store -> one TaskGroup owns the engine
server (and, per engine namespace, a scheduler task), the HTTP control API and the L3 probe ->
print one `ready` line (socket, HTTP port) -> run until SIGTERM or SIGINT -> drain: stop
listening, let in-flight loads finish within `service.drain_timeout_s` (cancel the rest; both
counted in the log), close sessions, flush what the write policy owes to L3 -> close the store
and the backend -> exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys

from hicache.config import LoadedConfig
from hicache.errors import HicacheError
from hicache.service.http_api import start_http
from hicache.service.logs import configure
from hicache.service.metrics import ServiceMetrics
from hicache.service.server import EngineServer
from hicache.storage import GuardedStore
from hicache.storage.factory import make_backend as make_store
from hicache.transfer import make_backend

log = logging.getLogger("hicache.service")


async def _probe_l3(server: EngineServer) -> None:
    while True:
        store = server.store
        await asyncio.sleep(1.0 if store is None else max(0.1, store.breaker.reset_after_s / 2))
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


async def serve(loaded: LoadedConfig, stop: asyncio.Event | None = None) -> int:
    d = loaded.deployment
    configure(d.service.log_format)
    layer_map = loaded.layer_map()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    backend = make_backend(d.device.kind, d.device.index, d.host.pin_chunk_bytes)
    store_backend = make_store(d.storage)
    store = GuardedStore(store_backend) if store_backend is not None else None
    metrics = ServiceMetrics()
    metrics.page_size_tokens = d.model.page_size_tokens
    server: EngineServer | None = None
    try:
        async with asyncio.TaskGroup() as tg:
            server = EngineServer(
                d, layer_map, backend, store, tg, metrics, model_name=loaded.model_name()
            )
            metrics.watch(lambda: list(server.namespaces.values()), lambda: server.store)
            await server.start()
            runner = None
            http_port = None
            if d.service.http_port is not None:
                runner, http_port = await start_http(
                    server, metrics, d.service.http_host, d.service.http_port
                )
            probe = tg.create_task(_probe_l3(server), name="hicache-l3-probe")
            fields = {
                "socket": str(d.service.socket_path),
                "tcp_port": server.tcp_port,
                "http_port": http_port,
                "model": layer_map.model_type,
                "model_name": server.model_name,
                "l3": d.storage.kind,
            }
            gc.freeze()  # start-up objects (torch's among them) leave the collector's scans
            log.info("serving", extra={"fields": fields})
            print(
                "hicache serve: ready "
                + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None),
                flush=True,
            )
            await stop.wait()
            log.info("draining", extra={"fields": {"sessions": len(server.sessions)}})
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
                }
            },
        )
    except BaseExceptionGroup as group:
        # the TaskGroup wraps what its body raised: a start-up error reaches the CLI as itself
        if server is not None and server.listening:
            with contextlib.suppress(OSError):
                d.service.socket_path.unlink()  # no socket left behind that nobody serves
        first = _first_hicache_error(group)
        if first is None:
            raise
        raise first from None
    finally:
        live = server.store if server is not None else store
        if live is not None:
            with contextlib.suppress(Exception):
                await live.backend.close()
        backend.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        sys.stdout.flush()
    return 0
