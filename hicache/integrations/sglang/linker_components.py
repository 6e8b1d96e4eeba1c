"""SGLang's device pools the linker moves, one per component, each bound to the sidecar's group
of its kind. No sglang import: it reads SGLang's pool objects (`MHATokenToKVPool`, an
`SWAKVPool`'s `full_kv_pool` and `swa_kv_pool`, a `HybridLinearKVPool`'s `full_kv_pool` and
`req_to_token_pool.mamba_pool`).

    FULL  -> pool "kv":    the full-attention layers' K / V  -> the sidecar's full group
    SWA   -> pool "swa":   the sliding layers' K / V (token slots of SGLang's SWA allocator)
                           -> the sidecar's sliding group
    MAMBA -> pool "mamba": the Mamba layers' conv / temporal state, one slot per state
                           (`linker_state`) -> the sidecar's state group

Every pool's layers must be the group's (SGLang's `model_layer_ids` against the sidecar's layer
ids), its rows the group's geometry (`KvTensors.check`); a pool SGLang has and the sidecar does
not model (or the reverse) is refused by name (`PoolShapeError`), at construction, never on the
data path.

Lifecycle (the linker, once, at construction; CPU):
    pools = LinkedPools.of(kv_cache, geometries, cuda=False)  # checked, then shared in place
                                                              # or rebacked (one memfd for all)
    pools.register(client)        # per client of the link: a SharedPools of every group
    ... the engine runs ...
    pools.close()                 # the memfd's descriptor; the mapping lives with the pool
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hicache.client import Client
from hicache.errors import PoolShapeError
from hicache.integrations.core.shared_memory import SharedRegions
from hicache.integrations.sglang.linker_pool import (
    KvTensors,
    PoolTensors,
    share_pools,
    shared_pools_of,
    token_groups,
)
from hicache.integrations.sglang.linker_state import StateTensors
from hicache.memory import GroupGeometry

log = logging.getLogger("hicache.sglang")

KV, SWA, MAMBA = "kv", "swa", "mamba"  # SGLang's PoolName values


@dataclass
class Component:
    """One SGLang device pool and the sidecar group it is."""

    pool: str  # SGLang's pool name: "kv", "swa" or "mamba"
    sglang_pool: Any  # the MHATokenToKVPool (or MambaPool) holding its tensors
    geometry: GroupGeometry
    tensors: PoolTensors

    @property
    def group(self) -> str:
        return self.geometry.group.name

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(self.geometry.group.layer_ids)


class LinkedPools:
    """SGLang's pools by SGLang pool name, shared with the sidecar (see the module doc)."""

    def __init__(
        self, components: dict[str, Component], memory: SharedRegions | None, num_layers: int
    ):
        self.components = components
        self.memory = memory
        self.num_layers = num_layers  # the model's layers, 0 .. num_layers - 1, each in one pool

    @classmethod
    def of(
        cls,
        kv_cache: Any,
        geometries: Mapping[str, GroupGeometry],
        cuda: bool,
        mamba_pool: Any = None,
    ) -> LinkedPools:
        """`mamba_pool`: SGLang's `req_to_token_pool.mamba_pool` where the tree has a MAMBA
        component, else None."""
        full, sliding, state = token_groups(geometries)
        if (mamba_pool is None) != (state is None):
            theirs = f"state group {state.group.name!r}" if state else "no state group"
            raise PoolShapeError(
                f"SGLang has {'a' if mamba_pool is not None else 'no'} Mamba pool; the "
                f"sidecar's model has {theirs}: SGLang and the sidecar must serve the same model"
            )
        swa_pool = getattr(kv_cache, "swa_kv_pool", None)
        kind = type(kv_cache).__name__
        if (swa_pool is None) != (sliding is None):
            theirs = f"sliding group {sliding.group.name!r}" if sliding else "no sliding group"
            raise PoolShapeError(
                f"SGLang's KV pool is a {kind} ({'with' if swa_pool is not None else 'no'} "
                f"sliding-window pool); the sidecar's model has {theirs}: SGLang and the "
                "sidecar must serve the same model (is SWA disabled in SGLang?)"
            )
        # an SWAKVPool or a HybridLinearKVPool keeps the full-attention layers in full_kv_pool
        parts = [(KV, getattr(kv_cache, "full_kv_pool", kv_cache), full)]
        if swa_pool is not None and sliding is not None:
            parts.append((SWA, swa_pool, sliding))
        components = {}
        for name, pool, geometry in parts:
            tensors = KvTensors.of(pool)
            tensors.check(geometry)
            check_layers(name, pool, geometry)
            components[name] = Component(name, pool, geometry, tensors)
        if mamba_pool is not None and state is not None:
            view = StateTensors.of(mamba_pool, state)
            components[MAMBA] = Component(MAMBA, mamba_pool, state, view)
        layer_ids = sorted(i for c in components.values() for i in c.layer_ids)
        layers = int(getattr(kv_cache, "layer_num", len(layer_ids)))
        if layer_ids != list(range(layers)):
            raise PoolShapeError(
                f"SGLang's KV pool counts {layers} layers; the sidecar's groups hold layers "
                f"{layer_ids} (SGLang's layer counter needs each of its layers from one pool)"
            )
        memory = None
        if not cuda:
            memory, how = share_pools([(c.tensors, c.sglang_pool) for c in components.values()])
            for component in components.values():  # rebacked: the pools' new tensors
                if component.pool == MAMBA:
                    component.tensors = StateTensors.of(component.sglang_pool, component.geometry)
                else:
                    component.tensors = KvTensors.of(component.sglang_pool)
            log.info("hicache: SGLang's pools %s shared with the sidecar %s", list(components), how)
        return cls(components, memory, layers)

    def pages_of(self, pool: str, pages: Sequence[int]) -> dict[str, list[int | None]]:
        """A store's device pages: `pages` for `pool`'s group, None for every other token
        group (a store names them all; SGLang offloads each pool on its own; a state store
        names none: `pool` "mamba")."""
        return {
            c.group: list(pages) if c.pool == pool else [None] * len(pages)
            for c in self.components.values()
            if c.pool != MAMBA
        }

    def register(self, client: Client) -> None:
        parts = [(c.tensors, c.geometry) for c in self.components.values()]
        if self.memory is None:  # CUDA: IPC handles
            pools = {}
            for tensors, geometry in parts:
                pools.update(tensors.device_pools(geometry))
            client.register_cuda_pools(pools)
        else:
            client.register_pools(shared_pools_of(self.memory, parts))

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()


def check_layers(pool: str, sglang_pool: Any, geometry: GroupGeometry) -> None:
    """SGLang's model layer ids of the pool (set where SGLang knows them: an SWAKVPool's
    sub-pools) must be the group's."""
    ids = getattr(sglang_pool, "model_layer_ids", None)
    want = tuple(geometry.group.layer_ids)
    if ids is not None and tuple(int(i) for i in ids) != want:
        raise PoolShapeError(
            f"SGLang's {pool!r} pool holds layers {list(ids)}; the sidecar's group "
            f"{geometry.group.name!r} layers {list(want)}"
        )
