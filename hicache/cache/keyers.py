"""`page_keyers`: the keyer of every group a cache keeps, each in its own namespace (model
identity, dtypes, geometry, page size, group, tensor-parallel rank and size, pipeline stage,
tenant salt). Pure: the sidecar's `hello` gives an engine these keyers' roots before any cache
exists, and `TieredCache.build` keys its index with the same ones."""

from __future__ import annotations

from collections.abc import Mapping

from hicache.index import Namespace, PageKeyer
from hicache.memory import GroupGeometry
from hicache.model import LayerMap
from hicache.scheduler.moves import MovePolicy, moves_group


def page_keyers(
    geometries: Mapping[str, GroupGeometry],
    layer_map: LayerMap,
    move_policy: MovePolicy,
    *,
    model: str = "",
    tenant_salt: str = "",
    tp_rank: int = 0,
    key_algorithm: str = "xxh3_128",
) -> dict[str, PageKeyer]:
    """The keyer of every group the cache keeps (the move policy may leave some to the
    engine: never stored, never needed for a hit), each in its own namespace. Pure: the
    sidecar's `hello` gives an engine these keyers' roots before any cache exists.
    Tensor parallelism: a group's namespace holds `tp_rank` and the layout's tp_size, except
    that a group replicated across ranks (`CacheGroup.replicated`) is keyed as rank 0 on
    every rank: one L3 object serves them all. The size stays in its keys: a deployment of
    another tp_size reduces in another order, so its latents may differ in the last bits."""
    keyers = {}
    tp_size = layer_map.layout.tp_size
    for name, geom in geometries.items():
        if not moves_group(move_policy, geom.group):
            continue
        replicated = geom.group.replicated and tp_size > 1  # tp_size 1: keys as before
        namespace = Namespace(
            model=model or layer_map.model_type,
            model_type=layer_map.model_type,
            dtype=geom.dtype_signature,
            kv_layout=repr(geom.group.spec),
            page_size_tokens=geom.page_size_tokens,
            group=name,
            tp_rank=0 if replicated else tp_rank,
            tp_size=tp_size,
            pp_rank=layer_map.start_layer,
            tenant_salt=tenant_salt,
        )
        keyers[name] = PageKeyer(namespace, key_algorithm)
    return keyers
