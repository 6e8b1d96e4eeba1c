"""`ServerState`: everything the engine channel's ops share, in one explicit object — the
deployment and what is derived from it once (geometries, the layout summary hello checks, the
groups the cache keys), the layer map, model name, copy backend, L3 store and metrics; the
namespaces and sessions; the service's TaskGroup; the session and load id counters.

Lifecycle: `EngineServer` builds it once (`ServerState.build`) and hands the same object to
each op class (`ops_session`, `ops_pools`, `ops_lookup`, `ops_data`); the server adds and
removes sessions, the pool registration adds namespaces, the admin API swaps `store`. Its
two gates, `ready` and `readable`, say which namespace a session's op may use (or why
none)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

from hicache.cache.keyers import page_keyers
from hicache.channel import protocol as p
from hicache.config import Deployment
from hicache.config.schema import ServiceSection
from hicache.memory import CacheDtypes, GroupGeometry
from hicache.model import LayerMap
from hicache.service.metrics import ServiceMetrics
from hicache.service.namespaces import Namespace, NamespaceKey
from hicache.service.sessions import Session
from hicache.storage import GuardedStore
from hicache.transfer import CopyBackend


@dataclass
class ServerState:
    deployment: Deployment
    layer_map: LayerMap
    model_name: str  # in every page key: the weights' identity
    backend: CopyBackend
    store: GuardedStore | None  # L3; swapped at runtime by the admin API (`set_store`)
    metrics: ServiceMetrics
    tg: asyncio.TaskGroup  # namespaces' scheduler tasks and the watchdog run in it
    geometries: dict[str, GroupGeometry]
    layout: dict[str, Any]  # the layout summary an engine's hello must match
    key_groups: tuple[str, ...]  # the groups the cache keys (the move policy may drop some)
    namespaces: dict[NamespaceKey, Namespace] = field(default_factory=dict)
    sessions: dict[int, Session] = field(default_factory=dict)
    session_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    load_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    @classmethod
    def build(
        cls,
        deployment: Deployment,
        layer_map: LayerMap,
        backend: CopyBackend,
        store: GuardedStore | None,
        tg: asyncio.TaskGroup,
        metrics: ServiceMetrics,
        *,
        model_name: str,
    ) -> ServerState:
        dtypes = CacheDtypes.of_model(deployment.model)
        page = deployment.model.page_size_tokens
        geometries = {g.name: GroupGeometry.of(g, dtypes, page) for g in layer_map.groups}
        return cls(
            deployment=deployment,
            layer_map=layer_map,
            model_name=model_name,
            backend=backend,
            store=store,
            metrics=metrics,
            tg=tg,
            geometries=geometries,
            layout=p.layout_summary(layer_map, geometries, page),
            key_groups=tuple(page_keyers(geometries, layer_map, deployment.scheduler.move_policy)),
        )

    @property
    def service(self) -> ServiceSection:
        return self.deployment.service

    def ready(self, session: Session, op: str) -> Namespace:
        """The namespace an engine session's store, load or release uses: refused for a
        'lookup' session, not ready before its pools are registered."""
        if session.lookup_only:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"{op}: this session said hello with role 'lookup'; it may only lookup, "
                "prefetch and ask stats",
            )
        if session.namespace is None:
            raise p.RequestError(p.ErrorCode.NOT_READY, f"{op}: send register_pools first")
        return session.namespace

    def readable(self, session: Session, op: str) -> Namespace | None:
        """The namespace a lookup reads: an engine session's own, or for a 'lookup' session
        its namespace while a session of its own engine (same `engine` name in hello) is
        attached there: None while none is, so a scheduler never promises hits only another
        engine could load."""
        if session.lookup_only:
            if session.key is None:
                raise p.RequestError(p.ErrorCode.NOT_READY, f"{op}: send hello first")
            namespace = self.namespaces.get(session.key)
            if namespace is None or not any(
                (worker := self.sessions.get(sid)) is not None and worker.engine == session.engine
                for sid in namespace.attached
            ):
                # no worker of *this* engine is attached: its hits could not be loaded
                # (only other engines' workers are, or none is)
                return None
            return namespace
        return self.ready(session, op)
