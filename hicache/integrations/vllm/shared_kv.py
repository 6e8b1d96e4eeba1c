"""vLLM's KV blocks as the pool the sidecar copies into: no staging, one copy per page.

CPU. vLLM allocates its KV cache as one allocation (`torch.zeros` of
`VLLM_CPU_KVCACHE_SPACE`, every layer a view, hybrid groups overlaying it); the sidecar can
map only a sealed memfd. `share_blocks` finds that one storage under every binding and the
span their rows reach, and hands both to `core.shared_memory.share_in_place`, which gives the
pages under that span shared backing without moving them (the rules — which pages an
allocation owns alone, which mappings may be replaced — are the core's, one set for vLLM and
SGLang). Only the span: the memfd must end where the rows do, or the sidecar refuses the
manifest (it maps no slack). Every tensor vLLM holds keeps its address and now
reads and writes the memfd. Bindings in several storages (no vLLM we know lays them out so),
or memory the core refuses, raise `SharedMemoryError` naming vLLM's KV cache and the reason;
`data_plane` logs it and the connector falls back to its staging pool.

`blocks_pools` describes vLLM's blocks as hicache's pools over that memfd: per group, layer and
tensor the memfd offset of block 0's part (`SharedRegions.offset_of`) and the block stride
(`page_strides`), so the sidecar maps them as page rows (`hicache.channel.shm`), checks every
row is in bounds, and its copies land in vLLM's blocks. `blocks_device_pools` is the same for
CUDA tensors, registered by IPC handle (`register_cuda_pools`).

Isolation is the sidecar's usual: a session registers only memory of its own process, so a
buggy engine reaches only its own blocks; no L2 page is ever mapped into an engine.

Lifecycle (the worker, once, in `register_kv_caches`; `data_plane` chooses and does this):
    memory = share_blocks(bindings)                      # SharedMemoryError: use staging
    pools = blocks_pools(memory, bindings, geometries)   # a SharedPools of vLLM's blocks
    client.register_pools(pools)                         # page ids are vLLM's block ids
    ... vLLM runs; `memory` (its descriptor) stays open; each client closes its own dup ...
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hicache.channel.shm import SharedPools
from hicache.client import Client
from hicache.integrations.core.shared_memory import (
    SharedMemoryError,
    SharedRegions,
    share_in_place,
)
from hicache.integrations.vllm.binding import LayerBinding
from hicache.memory import DevicePool, GroupGeometry
from hicache.model import LayerMap

WHAT = "vLLM's KV cache"  # how errors name the memory
MEMFD_NAME = "hicache-vllm-kv"

log = logging.getLogger("hicache.vllm")


def storage_and_reach(
    bindings: Mapping[int, LayerBinding],
) -> tuple[torch.UntypedStorage, int, int]:
    """The one storage every binding's blocks are views of, and the first and end address
    their rows reach."""
    storages = {
        b.blocks.untyped_storage().data_ptr(): b.blocks.untyped_storage() for b in bindings.values()
    }
    if len(storages) != 1:
        raise SharedMemoryError(
            f"vLLM's KV tensors live in {len(storages)} allocations; sharing in place needs "
            "one (vLLM's CPU worker makes one, every layer a view of it)"
        )
    lo = min(b.blocks.data_ptr() for b in bindings.values())
    hi = max(
        b.blocks.data_ptr() + (b.blocks.shape[0] - 1) * b.blocks.stride(0) + b.blocks.shape[1]
        for b in bindings.values()
    )
    return next(iter(storages.values())), lo, hi


def share_blocks(bindings: Mapping[int, LayerBinding]) -> SharedRegions:
    """Back the pages under every binding's rows with a sealed memfd, in place
    (`core.shared_memory.share_in_place`): only the pages the rows reach, so that the memfd
    ends where the pool manifest's rows do (the sidecar maps no slack). Nothing else writes
    them meanwhile (vLLM is registering its KV cache)."""
    storage, lo, hi = storage_and_reach(bindings)
    return share_in_place([storage], WHAT, MEMFD_NAME, reach=[(lo, hi)])


def blocks_pools(
    memory: SharedRegions,
    bindings: Mapping[int, LayerBinding],
    geometries: Mapping[str, GroupGeometry],
) -> SharedPools:
    """vLLM's blocks as a `SharedPools` over `memory`: page p of a group is block p. It holds
    a descriptor of its own (a dup of the memfd's), since the client that registers it
    closes it with itself: a client that failed must not take the memory's descriptor along,
    or no later client could register it."""
    offsets: dict[str, list[list[int]]] = {}
    strides: dict[str, list[list[int]]] = {}
    pages: dict[str, int] = {}
    for name, geometry in geometries.items():
        offsets[name], strides[name] = [], []
        for layer_id in geometry.group.layer_ids:
            binding = bindings[layer_id]
            rows = binding.blocks
            if pages.setdefault(name, rows.shape[0]) != rows.shape[0]:
                raise SharedMemoryError(
                    f"group {name!r}: layer {layer_id} has {rows.shape[0]} vLLM blocks, another "
                    f"layer {pages[name]}; one pool needs one block count"
                )
            base = memory.offset_of(rows.data_ptr())
            offsets[name].append([base + first for _, first, _ in binding.parts])
            strides[name].append([rows.stride(0)] * len(binding.parts))
    return SharedPools(
        os.dup(memory.fd), memory.nbytes, dict(geometries), pages, offsets, memory.buffer(), strides
    )


def blocks_device_pools(
    bindings: Mapping[int, LayerBinding], geometries: Mapping[str, GroupGeometry]
) -> dict[str, DevicePool]:
    """vLLM's blocks (any device) as hicache pools of page rows: for CUDA's
    `register_cuda_pools`, whose IPC handles carry each view's offset and stride."""
    pools = {}
    for name, geometry in geometries.items():
        layers = []
        for layer_id in geometry.group.layer_ids:
            binding = bindings[layer_id]
            layers.append(
                {tensor: binding.blocks[:, first:end] for tensor, first, end in binding.parts}
            )
        pools[name] = DevicePool(geometry, layers)
    return pools


@dataclass
class DataPlane:
    """How the sidecar reaches vLLM's blocks. `register`: registers them with a new client
    (None: the worker stages through a pool of its own); `stream`: CUDA, vLLM's current stream
    (the fence of a store and of a direct load), else None; `memory`: the CPU memory shared
    in place (kept open while vLLM runs)."""

    register: Callable[[Client], None] | None
    stream: Callable[[], Any]
    memory: SharedRegions | None = None


def data_plane(
    layer_map: LayerMap,
    bindings: Mapping[int, LayerBinding],
    geometries: Mapping[str, GroupGeometry],
    staging_pages: int | None,
) -> DataPlane:
    """Directly (CPU: the KV memory shared in place; CUDA: IPC handles), or through a staging
    pool when a hicache group's layers lie in several vLLM KV-cache groups (each with its own
    block ids: one page id cannot name them all), `staging_pages` is set, or the memory
    cannot be shared (the reason is logged)."""
    spans = {
        g.name: sorted({bindings[i].vllm_group for i in g.layer_ids}) for g in layer_map.groups
    }
    why = None
    if staging_pages is not None:
        why = "kv_connector_extra_config.staging_pages is set"
    elif any(len(v) > 1 for v in spans.values()):
        why = f"hicache groups span several vLLM KV-cache groups ({spans})"
    device = next(iter(bindings.values())).blocks.device
    if why is None and device.type == "cuda":
        from hicache.transfer.cuda_ipc import current_stream

        cuda_pools = blocks_device_pools(bindings, geometries)
        log.info("hicache: vLLM's CUDA blocks registered by IPC handle (no staging)")
        return DataPlane(
            lambda c: c.register_cuda_pools(cuda_pools), lambda: current_stream(device)
        )
    memory = None
    if why is None:
        try:
            memory = share_blocks(bindings)
        except SharedMemoryError as exc:
            why = str(exc)
    if memory is None:
        log.info("hicache: staging vLLM's blocks (%s)", why)
        return DataPlane(None, lambda: None)
    log.info("hicache: vLLM's KV memory shared in place (no staging)")
    shared = memory
    # a pool (and descriptor) per client: a client closes its pool with itself
    return DataPlane(
        lambda c: c.register_pools(blocks_pools(shared, bindings, geometries)),
        lambda: None,
        memory,
    )
