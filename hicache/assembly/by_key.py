"""An `EmbeddedCache` and a `TieredCache` from the schema's defaults plus the keys a caller
changes, by name (`host_capacity_bytes` is `host.capacity_bytes`, `queue_depth` is
`scheduler.queue_depth`, `prefetch_policy` is `cache.prefetch_policy`, ...), on a layer map
of the caller's: what tests and benchmarks build without a deployment file. No default is
repeated here: each section is built (and validated) by the schema, then read as a
deployment's is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hicache.assembly.settings import cache_settings, sections_stack_settings
from hicache.assembly.settings import device_pages as pages_for
from hicache.cache import TieredCache
from hicache.config.schema import CacheSection, DeviceSection, HostSection, SchedulerSection
from hicache.embedded import EmbeddedCache
from hicache.memory import CacheDtypes, DevicePool, HostTier, group_geometries
from hicache.model import LayerMap
from hicache.scheduler import Clock
from hicache.storage import GuardedStore
from hicache.transfer import CopyBackend, make_backend

_HOST = {"host_capacity_bytes": "capacity_bytes", "host_layout": "layout"}
_HOST |= {"host_state_fraction": "state_fraction"}


def _split(
    given: dict[str, Any], fields: Mapping[str, Any], rename: Mapping[str, str]
) -> dict[str, Any]:
    """Take from `given` the keys that name one of `fields` (through `rename`)."""
    taken = {}
    for name in list(given):
        field = rename.get(name, name)
        if field in fields:
            taken[field] = given.pop(name)
    return taken


def embedded(
    layer_map: LayerMap,
    *,
    dtype: torch.dtype | CacheDtypes,
    page_size_tokens: int,
    device_pages: int | Mapping[str, int] | None = None,
    backend: CopyBackend | None = None,
    device_pools: Mapping[str, DevicePool] | None = None,
    host_pages_per_group: Mapping[str, int] | None = None,
    clock: Clock | None = None,
    tp_rank: int | None = None,
    host_tier: HostTier | None = None,
    **keys: Any,
) -> EmbeddedCache:
    """`EmbeddedCache.build` with host and scheduler keys by name (schema defaults for the
    rest); `device_pages` default: what `device.pool_capacity_bytes` buys; `backend`
    default: a CPU backend."""
    host = HostSection(**_split(keys, HostSection.model_fields, _HOST))
    scheduler = SchedulerSection(**_split(keys, SchedulerSection.model_fields, {}))
    if keys:
        raise TypeError(
            f"by_key.embedded: unknown keys {sorted(keys)}; allowed: the host and scheduler "
            "sections' keys (host ones prefixed host_)"
        )
    dtypes = dtype if isinstance(dtype, CacheDtypes) else CacheDtypes.uniform(dtype)
    if device_pages is None:
        geometries = group_geometries(layer_map.groups, dtypes, page_size_tokens)
        device_pages = pages_for(DeviceSection(), geometries)
    settings = sections_stack_settings(
        dtypes,
        page_size_tokens,
        dict(device_pages) if isinstance(device_pages, Mapping) else device_pages,
        host,
        scheduler,
    )
    return EmbeddedCache.build(
        layer_map,
        settings,
        backend=backend if backend is not None else make_backend("cpu"),
        device_pools=device_pools,
        host_pages_per_group=host_pages_per_group,
        clock=clock,
        tp_rank=tp_rank,
        host_tier=host_tier,
    )


def tiered(
    stack: EmbeddedCache,
    *,
    store: GuardedStore | None = None,
    model: str = "",
    tenant: str = "",
    tp_rank: int | None = None,
    **keys: Any,
) -> TieredCache:
    """`TieredCache.build` with `cache` keys by name (schema defaults for the rest)."""
    section = CacheSection(**keys)
    return TieredCache.build(
        stack, cache_settings(section, tenant), store=store, model=model, tp_rank=tp_rank
    )
