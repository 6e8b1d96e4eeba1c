"""`CacheSettings`: what a `TieredCache` is built with, as plain values with no defaults of
their own. `hicache.assembly.cache_settings` reads them from a deployment's `cache` section
(whose defaults are the only ones), so an embedded cache and the sidecar's are built alike.
`index_of` and `prefetch_of` make the parts `TieredCache.build` builds from them; `effective`
reads back what a built cache runs with (`TieredCache.effective_settings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hicache.cache.keyers import page_keyers
from hicache.index import GroupRule, PrefetchPolicy, PrefixIndex
from hicache.index.policies import prefetch_policy

if TYPE_CHECKING:
    from hicache.cache.tiered import TieredCache
    from hicache.embedded import EmbeddedCache


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """The `cache` section's knobs by name; `tenant_salt` is the effective salt mixed into
    every page key (the section's salt with the namespace's tenant, `assembly.tenant_salt`)."""

    write_policy: str
    prefetch_policy: str
    prefetch_timeout_s: float | Literal["auto"]
    prefetch_timeout_per_token_s: float
    prefetch_auto_headroom: float
    prefetch_auto_floor_s: float
    prefetch_timeout_max_s: float
    eviction: str
    key_algorithm: str
    tenant_salt: str
    l3_index_max_pages: int
    l3_absent_ttl_s: float
    persist_queue_pages: int


def index_of(
    embedded: EmbeddedCache, settings: CacheSettings, *, model: str, tp_rank: int
) -> PrefixIndex:
    """The index of a cache over `embedded`: each kept group's keyer (`page_keyers`: the
    model, tenant salt, rank and key algorithm in every key), rule and L2 capacity, with the
    settings' eviction and bound on L3-only records."""
    geometries = embedded.geometries
    page = next(iter(geometries.values())).page_size_tokens
    keyers = page_keyers(
        geometries,
        embedded.layer_map,
        embedded.scheduler.move_policy,
        model=model,
        tenant_salt=settings.tenant_salt,
        tp_rank=tp_rank,
        key_algorithm=settings.key_algorithm,
    )
    rules, capacity = {}, {}
    for name in keyers:
        rules[name] = GroupRule.of(geometries[name].group)
        capacity[name] = embedded.host_tier.pool(name).num_pages
    return PrefixIndex(
        keyers, rules, capacity, page, settings.eviction, settings.l3_index_max_pages
    )


def prefetch_of(settings: CacheSettings) -> PrefetchPolicy:
    """The prefetch policy the settings name, given their deadline knobs (`index.policies`)."""
    return prefetch_policy(
        settings.prefetch_policy,
        timeout_s=settings.prefetch_timeout_s,
        per_token_s=settings.prefetch_timeout_per_token_s,
        headroom=settings.prefetch_auto_headroom,
        floor_s=settings.prefetch_auto_floor_s,
        max_s=settings.prefetch_timeout_max_s,
    )


def effective(cache: TieredCache) -> dict[str, object]:
    """What this cache runs with, read back from its parts, by the deployment key each
    comes from: the stack's (`EmbeddedCache.effective_settings`), the policies, the
    index's bounds, the persist queue, the page keys' roots (model, tenant salt, rank,
    algorithm, geometry) and L3's store (`GuardedStore.effective_settings`)."""
    prefetch = cache.prefetch_policy
    timeout = {
        "cache.prefetch_timeout_s": getattr(prefetch, "base_s", None),
        "cache.prefetch_timeout_per_token_s": getattr(prefetch, "per_token_s", None),
        "cache.prefetch_auto_headroom": getattr(prefetch, "headroom", None),
        "cache.prefetch_auto_floor_s": getattr(prefetch, "floor_s", None),
        "cache.prefetch_timeout_max_s": getattr(prefetch, "max_s", None),
    }
    keyers = cache.index.keyers.values()
    store = {} if cache.l3 is None else cache.l3.effective_settings()
    return {
        **cache.embedded.effective_settings(),
        "cache.write_policy": cache.write_policy.name,
        "cache.prefetch_policy": prefetch.name,
        **timeout,
        "cache.eviction": cache.index.eviction,
        "cache.key_algorithm": sorted({k.algorithm for k in keyers}),
        "cache.key_roots": cache.key_roots(),
        "cache.l3_absent_ttl_s": cache.discovery.absent.ttl_s,
        "cache.persist_queue_pages": cache.persist.max_pages,
        "cache.l3_index_max_pages": cache.index.l3_only_max_pages,
        "cache.groups": sorted(cache.index.rules),
        **store,
    }
