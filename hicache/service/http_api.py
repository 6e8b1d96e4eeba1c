"""The HTTP control API beside the engine channel (aiohttp, on the sidecar's own loop: one
dependency, no ASGI layer or second server process; every handler reads snapshots).

    GET  /healthz                 200 while the process serves
    GET  /readyz                  200 while the engine channel listens: "ready", or "ready,
                                  degraded" with what is degraded listed (L3 behind an open or
                                  half-open breaker: its state and why; L2 still serves); 503
                                  with the reason only when not listening (not started yet,
                                  or draining)
    GET  /metrics                 Prometheus text format
    GET  /v1/config               the effective deployment, secrets redacted
    GET  /v1/stats                sessions, namespaces (L2, pins, queues, bytes), L3 counters
    POST /v1/admin/clear?tier=l2  drop every L2 page no op holds; says how many it dropped and
                                  how many ops held (tier=l3: delete known L3 pages)
    POST /v1/admin/l3/detach      stop using L3 (pages stay where they are)
    POST /v1/admin/l3/attach      use the configured L3 again (or a `storage` section as JSON)

Admin endpoints need `Authorization: Bearer <service.token>` when a token is configured
(401 without it). With no token they are off (403 saying how to turn them on) unless
`service.admin_without_token: true`, which opens them to every local user (a listener beyond
loopback requires a token, so that is as far as it reaches). Every admin call is logged
(`admin` events: the remote address, the action, what was asked, the outcome), refused ones
as warnings.
Lifecycle: `start_http(server, ...)` returns the runner; `runner.cleanup()` stops it.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import asdict
from typing import Any

from aiohttp import web

from hicache.assembly.sidecar import StorageBodyError
from hicache.errors import ServiceStartError
from hicache.service.metrics import ServiceMetrics
from hicache.service.server import EngineServer
from hicache.service.snapshots import namespace_stats, store_stats, tenant_stats
from hicache.storage.breaker import BreakerState
from hicache.transfer.rows import large_copy_stores

log = logging.getLogger("hicache.service.admin")

ADMIN_OFF = (
    "admin endpoints are off: no service.token is set; set service.token (or "
    "HICACHE_SERVICE__TOKEN) and send 'Authorization: Bearer <service.token>', or set "
    "service.admin_without_token: true to let every local user call them"
)


class ControlApi:
    def __init__(self, server: EngineServer, metrics: ServiceMetrics):
        self.server = server
        self.metrics = metrics
        self.app = web.Application()
        self.app.add_routes(
            [
                web.get("/healthz", self.healthz),
                web.get("/readyz", self.readyz),
                web.get("/metrics", self.metrics_text),
                web.get("/v1/config", self.config),
                web.get("/v1/stats", self.stats),
                web.post("/v1/admin/clear", self.clear),
                web.post("/v1/admin/l3/detach", self.l3_detach),
                web.post("/v1/admin/l3/attach", self.l3_attach),
            ]
        )

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "alive"})

    async def readyz(self, request: web.Request) -> web.Response:
        problems = []
        if not self.server.listening:
            problems.append(
                "draining (SIGTERM): refusing new engines"
                if self.server.draining
                else "engine channel not listening"
            )
        store = self.server.store
        breaker = None if store is None else store.breaker.describe()
        degraded = []
        if breaker is not None and breaker["state"] != BreakerState.CLOSED.value:
            trying = "a trial call is due" if breaker["state"] == "half_open" else "backend failing"
            degraded.append(
                {
                    "tier": "l3",
                    "kind": self.server.plan.storage_kind,
                    "breaker": breaker,
                    "effect": f"L3 breaker {breaker['state']} ({trying}); loads serve L2 only",
                }
            )
        status = "not ready" if problems else "ready, degraded" if degraded else "ready"
        body = {
            "ready": not problems,
            "status": status,
            "problems": problems,
            "degraded": degraded,
            "namespaces": len(self.server.namespaces),
            # an L2 shared by a rank's tenants (tenants.shared_l2) counted once
            "host_pools_bytes": sum(
                {
                    ns.l2_identity: ns.host_pools_bytes for ns in self.server.namespaces.values()
                }.values()
            ),
            "l3": self.server.plan.storage_kind if store is not None else "none",
            "l3_breaker": None if breaker is None else breaker["state"],
        }
        return web.json_response(body, status=200 if not problems else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.exposition(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def config(self, request: web.Request) -> web.Response:
        return web.json_response(self.server.plan.config_json())

    async def stats(self, request: web.Request) -> web.Response:
        store = self.server.store
        kv_events = self.server.state.kv_events
        row_kernel = getattr(self.server.backend, "row_kernel", None)
        return web.json_response(
            {
                "sessions": [
                    {
                        "id": s.id,
                        "engine": s.engine,
                        "pid": s.pid,
                        "namespace": str(s.key) if s.key else None,
                        "loads_unreleased": len(s.loads),
                    }
                    for s in self.server.sessions.values()
                ],
                "namespaces": [namespace_stats(ns) for ns in self.server.namespaces.values()],
                # each namespace's phase (starting, running, draining, closed), the sessions
                # attached and those waiting for its start (namespace_registry.py)
                "namespace_states": self.server.state.registry.snapshot(),
                "l3": store_stats(store),
                # per tenant: lookup hits, and its part of a shared L2 (tenants.shared_l2)
                "tenants": tenant_stats(
                    self.server.namespaces.values(), self.metrics.tenant_hit_tokens
                ),
                # lookups that waited for pages a store in flight was writing, by outcome
                "store_waits": asdict(self.server.state.store_waits.stats),
                # loads engines recomputed for want of their own staging pages (heartbeats)
                "engine_loads_starved": self.metrics.loads_starved_count,
                # the KV-event publisher (service.kv_events): sent, dropped; None when off
                "kv_events": None if kv_events is None else kv_events.stats(),
                # the CPU backend's row-copy kernel (native C, or numpy and why); None on CUDA
                "row_kernel": row_kernel,
                # what CPU copies of 8 MiB or more store with, measured on the first of them
                "large_copy_stores": None if row_kernel is None else large_copy_stores(),
            }
        )

    def _audit(
        self, request: web.Request, action: str, outcome: str, warn: bool = False, **asked: Any
    ) -> None:
        fields = {"remote": request.remote, "action": action, **asked, "outcome": outcome}
        (log.warning if warn else log.info)("admin", extra={"fields": fields})

    def _authorize(self, request: web.Request, action: str, **asked: Any) -> None:
        token = self.server.service.token
        if token is None:
            if self.server.service.admin_without_token:
                return
            self._audit(request, action, "refused: admin endpoints off", True, **asked)
            raise web.HTTPForbidden(text=ADMIN_OFF)
        given = request.headers.get("Authorization", "")
        want = f"Bearer {token.get_secret_value()}"
        if not hmac.compare_digest(given.encode(), want.encode()):
            why = "no Authorization header" if not given else "wrong token"
            self._audit(request, action, f"refused: {why}", True, **asked)
            raise web.HTTPUnauthorized(
                text="admin endpoints need 'Authorization: Bearer <service.token>'"
            )

    async def clear(self, request: web.Request) -> web.Response:
        tier = request.query.get("tier", "l2")
        self._authorize(request, "clear", tier=tier)
        if tier == "l2":
            namespaces = list(self.server.namespaces.values())
            dropped = sum(ns.cache.clear_l2() for ns in namespaces)
            # what stayed: pages an op holds now (a load's pins, an L3 write reading them, a
            # store's plan); a caller that wants them gone waits for those ops to end first
            indexes = [ns.cache.index for ns in namespaces]
            held = sum(index.l2_pages(group) for index in indexes for group in index.rules)
            self._audit(request, "clear", f"{dropped} L2 pages dropped, {held} held", tier=tier)
            return web.json_response({"tier": "l2", "pages_dropped": dropped, "pages_held": held})
        if tier == "l3":
            deleted = 0
            try:
                for ns in self.server.namespaces.values():
                    deleted += await ns.cache.clear_l3()
            except Exception as exc:
                self._audit(request, "clear", f"failed after {deleted}: {exc!r}", True, tier=tier)
                raise
            self._audit(request, "clear", f"{deleted} L3 pages deleted", tier=tier)
            return web.json_response({"tier": "l3", "pages_deleted": deleted})
        self._audit(request, "clear", "refused: unknown tier", True, tier=tier)
        raise web.HTTPBadRequest(text=f"tier {tier!r} is not known; allowed: l2, l3")

    async def l3_detach(self, request: web.Request) -> web.Response:
        self._authorize(request, "l3_detach")
        old = self.server.set_store(None)
        if old is not None:
            await old.backend.close()
        self._audit(request, "l3_detach", "detached" if old is not None else "no L3 attached")
        return web.json_response({"l3": "detached"})

    async def l3_attach(self, request: web.Request) -> web.Response:
        body = request.can_read_body
        self._authorize(request, "l3_attach", section="body" if body else "configured")
        try:
            attach = self.server.plan.attach_request(await request.json() if body else None)
        except StorageBodyError as exc:
            problem = str(exc)
            self._audit(request, "l3_attach", f"refused: {problem}", True, section="body")
            raise web.HTTPBadRequest(text="storage section: " + problem) from None
        except ValueError as exc:  # not JSON
            self._audit(request, "l3_attach", "refused: body is not JSON", True, section="body")
            raise web.HTTPBadRequest(
                text=f"storage section: the body is not JSON ({exc}); allowed: a storage "
                "section as a JSON object, or no body for the configured one"
            ) from None
        asked = attach.asked
        try:
            store = attach.open()
        except Exception as exc:
            self._audit(request, "l3_attach", f"failed: {exc!r}", True, **asked)
            raise
        old = self.server.set_store(store)
        if old is not None:
            await old.backend.close()
        self._audit(request, "l3_attach", f"attached {attach.kind}", **asked)
        return web.json_response({"l3": attach.kind})


async def start_http(
    server: EngineServer, metrics: ServiceMetrics, host: str, port: int
) -> tuple[web.AppRunner, int]:
    api = ControlApi(server, metrics)
    runner = web.AppRunner(api.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ServiceStartError(
            f"service.http_host/http_port: cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from exc
    bound = port
    server_obj = site._server
    if server_obj is not None:
        for sock in getattr(server_obj, "sockets", ()) or ():
            bound = int(sock.getsockname()[1])
            break
    return runner, bound
