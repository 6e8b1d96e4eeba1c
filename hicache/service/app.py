"""`hicache serve`: the long-running sidecar process.

Lifecycle: load the deployment -> check what needs the layout (the L2 budget holds a page of
every group) -> copy backend and L3 store -> one TaskGroup owns the engine server (and, per
engine namespace, a scheduler task), the HTTP control API and the L3 probe -> print one
`ready` line (socket, HTTP port) -> run until SIGTERM or SIGINT -> drain, all of it within
`service.drain_timeout_s`: stop listening, let in-flight loads finish (cancel those still
running at the deadline), close sessions, flush what the write policy owes to L3 in the time
left (what is still unwritten at the deadline is counted, not written) -> the `stopped` line
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
from collections.abc import Callable, Iterator

from aiohttp import web

from hicache.config import LoadedConfig, format_bytes
from hicache.config.capacity import warn_capacity
from hicache.config.schema import L3Guard
from hicache.config.urls import redacted_url
from hicache.errors import ConfigError, HicacheError, ServiceStartError
from hicache.memory import CacheDtypes, GroupGeometry
from hicache.memory.host_tier import budget_pages
from hicache.model import LayerMap
from hicache.service.http_api import start_http
from hicache.service.logs import configure
from hicache.service.metrics import ServiceMetrics
from hicache.service.server import EngineServer
from hicache.storage import GuardedStore
from hicache.storage.factory import guarded
from hicache.storage.factory import make_backend as make_store
from hicache.transfer import CopyBackend, make_backend

log = logging.getLogger("hicache.service")


def host_pages(loaded: LoadedConfig, layer_map: LayerMap) -> dict[str, int]:
    """The L2 pages per group `host.capacity_bytes` buys (`host_tier.budget_pages`, what
    each engine namespace allocates at `register_pools`); a budget that holds no page of a
    group is refused here, at start-up and by `hicache config validate`, naming the file (or
    variable), the size given and what one page needs. A tier too small for one long prompt
    is a warning (`hicache.config.capacity`), logged."""
    d = loaded.deployment
    dtypes = CacheDtypes.of_model(d.model)
    page = d.model.page_size_tokens
    geometries = [GroupGeometry.of(g, dtypes, page) for g in layer_map.groups]
    try:
        counts = budget_pages(geometries, d.host.capacity_bytes, d.host.state_fraction)
    except ConfigError as exc:
        pages = ", ".join(f"{g.name} {format_bytes(g.page_bytes)}" for g in geometries)
        raise ConfigError(
            f"{loaded.source_of('host.capacity_bytes')}: {exc}; one page of each group: {pages}"
        ) from None
    tokens = {g.name: g.page_bytes for g in geometries if g.group.kind.is_token_cache}
    states = {g.name: g.page_bytes for g in geometries if g.name not in tokens}
    warn_capacity(loaded, tokens, states, counts)  # a tier too small for one long prompt
    return counts


def _cause(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return " ".join(f"{type(exc).__name__}: {exc}".split())  # one line


@contextlib.contextmanager
def _starting(loaded: LoadedConfig, key: str, what: str) -> Iterator[None]:
    """One start-up step, configured by `key`: an error of a library it calls becomes a
    `ServiceStartError` naming where the key was set, the key, the step and the cause."""
    try:
        yield
    except HicacheError:
        raise
    except Exception as exc:
        raise ServiceStartError(f"{loaded.source_of(key)}: {key}: {what}: {_cause(exc)}") from exc


def _open_store(loaded: LoadedConfig) -> GuardedStore | None:
    """The L3 store of `storage`, or None; its backend's errors named by the key at fault,
    behind a `GuardedStore` with the section's timeouts, breaker thresholds and chunk size."""
    section = loaded.deployment.storage
    if section.kind == "file":
        key, what = "storage.path", f"cannot use {str(section.path)!r} as the L3 directory"
    elif section.kind == "redis":
        key, what = "storage.url", f"cannot use Redis at {redacted_url(section.url)!r}"
    elif section.kind == "mooncake":
        key, what = "storage.master_address", "cannot set up the Mooncake store client"
    else:
        return None
    try:
        with _starting(loaded, key, what):
            backend = make_store(section)
    except ServiceStartError as exc:
        if isinstance(exc.__cause__, ImportError):  # an optional extra not installed
            raise ServiceStartError(
                f"{loaded.source_of('storage.kind')}: storage.kind: {section.kind} needs "
                f"the {section.kind!r} extra (pip install 'hicache[{section.kind}]'): "
                f"{_cause(exc.__cause__)}"
            ) from exc.__cause__
        raise
    if backend is None or not isinstance(section, L3Guard):
        return None
    return guarded(backend, section)


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


async def serve(
    loaded: LoadedConfig,
    stop: asyncio.Event | None = None,
    *,
    backend_factory: Callable[[LoadedConfig], CopyBackend] | None = None,
) -> int:
    """Run the sidecar until `stop` (or SIGTERM / SIGINT); the exit code. `backend_factory`:
    builds the copy backend instead of `device.kind`'s (a harness's, `hicache.testing.serve`);
    serve owns and closes what it returns."""
    d = loaded.deployment
    configure(d.service.log_format)
    layer_map = loaded.layer_map()
    host_pages(loaded, layer_map)  # an L2 too small for one page: refused before anything starts
    with _starting(loaded, "model.name", "cannot derive the model name"):
        model_name = loaded.model_name()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    backend: CopyBackend | None = None
    store: GuardedStore | None = None
    server: EngineServer | None = None
    runner: web.AppRunner | None = None
    ready = False
    try:
        with _starting(loaded, "device.kind", f"cannot start the {d.device.kind} copy backend"):
            if backend_factory is not None:
                backend = backend_factory(loaded)
            else:
                backend = make_backend(d.device.kind, d.device.index, d.host.pin_chunk_bytes)
        store = _open_store(loaded)
        metrics = ServiceMetrics()
        metrics.page_size_tokens = d.model.page_size_tokens
        async with asyncio.TaskGroup() as tg:
            server = EngineServer(d, layer_map, backend, store, tg, metrics, model_name=model_name)
            metrics.watch(lambda: list(server.namespaces.values()), lambda: server.store)
            http_port = None
            if d.service.http_port is not None:  # first: it logs nothing if the rest fails
                runner, http_port = await start_http(
                    server, metrics, d.service.http_host, d.service.http_port
                )
            await server.start()
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
                        "drain_timeout_s": d.service.drain_timeout_s,
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
                d.service.socket_path.unlink()  # no socket left behind that nobody serves
        first = _first_hicache_error(group)
        if first is not None:
            raise first from None
        if ready:
            raise
        raise ServiceStartError(
            f"{loaded.path}: start-up failed: {_cause(group.exceptions[0])}"
        ) from group
    finally:
        if server is not None and not ready:
            await _close_listeners(server, runner, d.service.drain_timeout_s)
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
