"""`ServerState`: everything the engine channel's ops share, in one explicit object — the
sidecar's plan (`assembly.SidecarPlan`: the layer map, model name, geometries and the settings
read from the deployment) and what is derived from it once (the layout summary hello checks,
the groups the cache keys), copy backend, L3 store and metrics; the
namespaces and sessions; the service's TaskGroup; the session and load id counters; the
thread that prefaults engines' pools.

Lifecycle: `EngineServer` builds it once (`ServerState.build`) and hands the same object to
each op class (`ops_session`, `ops_pools`, `ops_lookup`, `ops_data`); the server adds and
removes sessions, the pool registration gets namespaces from `registry` (the one writer of
`namespaces`: the started ones by key), the admin API swaps `store`. Its
two gates, `ready` and `readable`, say which namespace a session's op may use (or why
none)."""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hicache.assembly import ServiceSettings
from hicache.assembly.sidecar import SidecarPlan
from hicache.cache.keyers import page_keyers
from hicache.channel import protocol as p
from hicache.memory import DevicePool, GroupGeometry
from hicache.model import LayerMap
from hicache.service.kv_events import KvEvents
from hicache.service.metrics import ServiceMetrics
from hicache.service.namespace_registry import NamespaceRegistry
from hicache.service.namespaces import Namespace, NamespaceKey
from hicache.service.sessions import Session
from hicache.service.store_waits import StoreWaits
from hicache.storage import GuardedStore
from hicache.transfer import CopyBackend


@dataclass
class ServerState:
    plan: SidecarPlan  # what this sidecar serves, read from the deployment by assembly
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
    # KV events for routers (`service.kv_events`; None: off), set by `serve` before listening
    kv_events: KvEvents | None = None
    # the one thread that prefaults engines' pools (`sessions.Prefaulting`), shut at the drain
    prefaults: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="hicache-prefault")
    )
    # lookups waiting for pages a store in flight is writing (`wait_stored_s`), counted
    store_waits: StoreWaits = field(default_factory=StoreWaits)
    # which namespace each key has, and its phase: the one writer of `namespaces`
    registry: NamespaceRegistry = field(init=False)

    def __post_init__(self) -> None:
        self.registry = NamespaceRegistry(self.namespaces, self.tg, self._start_namespace)

    async def _start_namespace(
        self, key: NamespaceKey, device_pools: dict[str, DevicePool]
    ) -> Namespace:
        namespace = await Namespace.start(
            key, self.plan, self.backend, self.store, device_pools, self.tg
        )
        if self.kv_events is not None:  # from its start: no store of it unseen
            self.kv_events.watch(namespace.cache.index)
        return namespace

    @classmethod
    def build(
        cls,
        plan: SidecarPlan,
        backend: CopyBackend,
        store: GuardedStore | None,
        tg: asyncio.TaskGroup,
        metrics: ServiceMetrics,
    ) -> ServerState:
        layer_map, geometries = plan.layer_map, plan.geometries
        return cls(
            plan=plan,
            backend=backend,
            store=store,
            metrics=metrics,
            tg=tg,
            geometries=geometries,
            layout=p.layout_summary(layer_map, geometries, plan.page_size_tokens),
            key_groups=tuple(page_keyers(geometries, layer_map, plan.move_policy)),
        )

    @property
    def service(self) -> ServiceSettings:
        return self.plan.service

    @property
    def layer_map(self) -> LayerMap:
        return self.plan.layer_map

    @property
    def model_name(self) -> str:
        """In every page key: the weights' identity."""
        return self.plan.model_name

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
