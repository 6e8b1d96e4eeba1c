"""The caches a deployment describes, built from one `Deployment`: the copy backend, the
embedded stack (`EmbeddedCache`), the tiered cache over it (`TieredCache`) — for an embedded
engine (`embedded_cache`) and for each of the sidecar's namespaces (`namespace_cache`), by
the same code, so both run with the same settings — and the start-up check of L2's budget
(`host_pages`).

Lifecycle: what is built here is the caller's: `cache.embedded.close()` stops the copy
backend (closed here when a build fails), `cache.l3.backend.close()` the L3 client.
"""

from __future__ import annotations

from collections.abc import Mapping

from hicache.assembly.settings import (
    cache_settings,
    geometries,
    stack_settings,
)
from hicache.assembly.stores import open_store
from hicache.assembly.tenants import TenantL2, check_tenant_shares
from hicache.cache import TieredCache
from hicache.config import LoadedConfig, format_bytes
from hicache.config.capacity import warn_capacity
from hicache.config.schema import Deployment
from hicache.embedded import EmbeddedCache, pools_device
from hicache.errors import ConfigError
from hicache.memory import DevicePool, HostTier
from hicache.memory.host_tier import budget_pages
from hicache.model import LayerMap
from hicache.scheduler import Clock
from hicache.storage import GuardedStore
from hicache.transfer import CopyBackend, make_backend


def copy_backend(
    d: Deployment, device_pools: Mapping[str, DevicePool] | None = None
) -> CopyBackend:
    """The copy backend of `device.kind`, bound to the pools' device when given (an engine's
    TP rank on its own GPU), else to `device.index`; `host.pin_chunk_bytes` and
    `host.prefault` for its host buffers."""
    where = pools_device(device_pools) if device_pools else None
    index = d.device.index if where is None or where.index is None else where.index
    return make_backend(d.device.kind, index, d.host.pin_chunk_bytes, prefault=d.host.prefault)


def embedded_stack(
    d: Deployment,
    layer_map: LayerMap,
    *,
    backend: CopyBackend | None = None,
    device_pools: Mapping[str, DevicePool] | None = None,
    clock: Clock | None = None,
    tp_rank: int | None = None,
    host_tier: HostTier | None = None,
) -> EmbeddedCache:
    """The stack a deployment describes, on `backend` (else its own, `copy_backend`) and the
    engine's `device_pools` (else pools of its own, `device.pool_capacity_bytes`); on
    `host_tier` when given (an L2 shared by tenants), else an L2 of its own. A build that
    fails closes the backend only if it is its own: a given one is the caller's (the
    sidecar's, shared by every namespace: one namespace's failed start must not stop the
    others' copies)."""
    settings = stack_settings(d, layer_map)  # before the backend: nothing to close if bad
    owns_backend = backend is None
    if backend is None:
        backend = copy_backend(d, device_pools)
    return EmbeddedCache.build(
        layer_map,
        settings,
        backend=backend,
        device_pools=device_pools,
        clock=clock,
        tp_rank=tp_rank,
        host_tier=host_tier,
        owns_backend=owns_backend,
    )


def tiered_cache(
    d: Deployment,
    embedded: EmbeddedCache,
    *,
    store: GuardedStore | None,
    model_name: str,
    tenant: str,
    tp_rank: int,
) -> TieredCache:
    """The tiered cache of `cache` over `embedded`, for `tenant` on rank `tp_rank`."""
    return TieredCache.build(
        embedded,
        cache_settings(d.cache, tenant),
        store=store,
        model=model_name,
        tp_rank=tp_rank,
    )


def namespace_cache(
    d: Deployment,
    layer_map: LayerMap,
    *,
    model_name: str,
    tenant: str,
    tp_rank: int,
    backend: CopyBackend,
    store: GuardedStore | None,
    device_pools: Mapping[str, DevicePool],
    shared_l2: TenantL2 | None = None,
) -> TieredCache:
    """One sidecar namespace's cache: the engine's pools, the sidecar's backend for their
    device (`for_device`: whatever `device.index` says, a TP rank's GPU), the sidecar's L3;
    with `shared_l2` (`tenants.shared_l2`), its rank's L2 shared with the other tenants."""
    backend = backend.for_device(pools_device(device_pools))
    host_tier = None if shared_l2 is None else shared_l2.tier(tp_rank)
    embedded = embedded_stack(
        d,
        layer_map,
        backend=backend,
        device_pools=device_pools,
        tp_rank=tp_rank,
        host_tier=host_tier,
    )
    cache = tiered_cache(
        d, embedded, store=store, model_name=model_name, tenant=tenant, tp_rank=tp_rank
    )
    if shared_l2 is not None:
        shared_l2.join(tp_rank, tenant, cache)
    return cache


def embedded_cache(
    loaded: LoadedConfig,
    *,
    tenant: str = "",
    tp_rank: int | None = None,
    device_pools: Mapping[str, DevicePool] | None = None,
    clock: Clock | None = None,
) -> TieredCache:
    """The whole cache an embedded engine runs: what `hicache serve` gives a namespace of
    `tenant` (default: none, the engine that names none) on `tp_rank`, in-process: the
    deployment's stack (`device_pools`: the engine's, else its own), its L3 store and every
    `cache` setting. Close with `cache.embedded.close()` and, when `cache.l3` is set,
    `await cache.l3.backend.close()`."""
    d = loaded.deployment
    layer_map = loaded.layer_map()
    model_name = loaded.model_name()
    embedded = embedded_stack(d, layer_map, device_pools=device_pools, clock=clock, tp_rank=tp_rank)
    try:
        store = open_store(loaded)
        return tiered_cache(
            d,
            embedded,
            store=store,
            model_name=model_name,
            tenant=tenant,
            tp_rank=embedded.tp_rank,
        )
    except BaseException:
        embedded.close()
        raise


def host_pages(loaded: LoadedConfig, layer_map: LayerMap) -> dict[str, int]:
    """The L2 pages per group `host.capacity_bytes` buys (`host_tier.budget_pages`, what
    each engine namespace allocates at `register_pools`); a budget that holds no page of a
    group is refused here, at start-up and by `hicache config validate`, naming the file (or
    variable), the size given and what one page needs. A tier too small for one long prompt
    is a warning (`hicache.config.capacity`), logged; a tenant's guaranteed share of L2
    smaller than one long prompt is refused (`check_tenant_shares`)."""
    d = loaded.deployment
    groups = list(geometries(d, layer_map).values())
    try:
        counts = budget_pages(groups, d.host.capacity_bytes, d.host.state_fraction)
    except ConfigError as exc:
        pages = ", ".join(f"{g.name} {format_bytes(g.page_bytes)}" for g in groups)
        raise ConfigError(
            f"{loaded.source_of('host.capacity_bytes')}: {exc}; one page of each group: {pages}"
        ) from None
    tokens = {g.name: g.page_bytes for g in groups if g.group.kind.is_token_cache}
    states = {g.name: g.page_bytes for g in groups if g.name not in tokens}
    warn_capacity(loaded, tokens, states, counts)  # a tier too small for one long prompt
    check_tenant_shares(loaded, counts, set(tokens))  # a guaranteed share smaller than one
    return counts
