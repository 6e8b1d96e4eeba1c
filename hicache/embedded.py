"""`EmbeddedCache`: the whole in-process stack for one pipeline stage, built from a deployment
or from parts: layer map -> geometries -> copy backend -> device pools (the engine's, or our
own for the demo) -> host tier -> scheduler.

Lifecycle: `EmbeddedCache.build(...)` (or `from_config`) allocates everything at start;
`async with cache.scheduler.running():` serves ops; `cache.close()` stops the copy backend
(queued copies finish, its thread is joined). An engine that raises before `close()`, or
never calls it, still exits: the backend's thread is a daemon, closed the same way at
interpreter exit (`hicache/transfer/workers.py`).

The copy backend is bound to one device: the pools' (an engine's own pools on its GPU), or
`device.index` when the stack allocates its own; pools on another device are refused, naming
both. On CUDA a backup is ordered after a fence (`TieredCache.store`, `Scheduler.backup`):
take it on the thread and stream that wrote the pages (`backend.producer_fence(stream)`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hicache.config.loader import LoadedConfig
from hicache.config.schema import Deployment
from hicache.errors import ConfigError
from hicache.memory import CacheDtypes, DevicePool, GroupGeometry, HostTier
from hicache.memory.host_pool import HostLayout
from hicache.model import LayerMap
from hicache.scheduler import Clock, MovePolicy, Scheduler
from hicache.transfer import CopyBackend, make_backend


def pools_device(device_pools: Mapping[str, DevicePool]) -> torch.device:
    """The one device every pool is on; refused when they differ (one stage, one device)."""
    devices = {pool.device for pool in device_pools.values()}
    if len(devices) != 1:
        where = ", ".join(f"{name} on {pool.device}" for name, pool in sorted(device_pools.items()))
        raise ConfigError(
            f"device pools on {len(devices)} devices ({where}); one stage's pools share one "
            "device (give each TP rank its own cache)"
        )
    return next(iter(devices))


def check_pools_device(device_pools: Mapping[str, DevicePool], backend: CopyBackend) -> None:
    """Refuse pools the copy backend cannot copy: on another device than the backend's
    (whose streams and staging live on its own device)."""
    device = pools_device(device_pools)
    if not backend.serves(device):
        raise ConfigError(
            f"device pools on {device}, but the copy backend copies on {backend.device}; bind "
            f"the backend to the pools' device (make_backend(kind, index={device.index}) or "
            "backend.for_device(device))"
        )


def rank_of(tp_rank: int | None, tp_size: int, where: str) -> int:
    """The rank a stack serves: `tp_rank` checked (`check_tp_rank`), or 0 when not given and
    the layout is not tensor-parallel. Not given at tp_size > 1 is refused: rank 0's keys on
    another rank would file that rank's heads under rank 0's pages, and a later load on rank
    0 would verify and serve them."""
    if tp_rank is None:
        if tp_size > 1:
            raise ConfigError(
                f"{where}: the layout is one rank's share of model.tp_size {tp_size}; say which "
                f"rank this stack serves (tp_rank=0..{tp_size - 1})"
            )
        return 0
    check_tp_rank(tp_rank, tp_size, where)
    return tp_rank


def check_tp_rank(tp_rank: int, tp_size: int, where: str) -> None:
    """A rank is one of its layout's tp_size (`model.tp_size`), else ConfigError. At tp_size
    1 any rank >= 0 passes: deployments from before `model.tp_size` give each rank its own
    hand-written per-rank layout and use tp_rank only to part their namespaces."""
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or tp_rank < 0:
        raise ConfigError(f"{where}: tp_rank {tp_rank!r}; allowed: an integer >= 0")
    if tp_size > 1 and tp_rank >= tp_size:
        raise ConfigError(
            f"{where}: tp_rank {tp_rank!r} is not a rank of the layout's tp_size {tp_size} "
            f"(model.tp_size); allowed: 0..{tp_size - 1}"
        )


@dataclass
class EmbeddedCache:
    layer_map: LayerMap
    geometries: dict[str, GroupGeometry]
    backend: CopyBackend
    device_pools: dict[str, DevicePool]
    host_tier: HostTier
    scheduler: Scheduler
    tp_rank: int = 0  # the tensor-parallel rank this stack serves: one of its layout's tp_size

    @property
    def tp_size(self) -> int:
        return self.layer_map.layout.tp_size

    @classmethod
    def build(
        cls,
        layer_map: LayerMap,
        *,
        dtype: torch.dtype | CacheDtypes,
        page_size_tokens: int,
        host_capacity_bytes: int,
        device_pages: int | Mapping[str, int] = 64,
        host_layout: HostLayout = "layer_first",
        host_state_fraction: float = 0.25,
        host_pages_per_group: Mapping[str, int] | None = None,
        backend: CopyBackend | None = None,
        device_pools: Mapping[str, DevicePool] | None = None,
        queue_depth: int = 64,
        inflight_bytes: int = 256 * 2**20,
        op_timeout_s: float = 30.0,
        move_policy: MovePolicy = "hybrid",
        counter_ring_size: int = 3,
        clock: Clock | None = None,
        tp_rank: int | None = None,
    ) -> EmbeddedCache:
        """One stage of one tensor-parallel rank (`tp_rank` of the layout's tp_size: an
        embedded engine is one rank, its layer map that rank's share, `shard_layout`)."""
        tp_rank = rank_of(tp_rank, layer_map.layout.tp_size, "EmbeddedCache.build")
        dtypes = dtype if isinstance(dtype, CacheDtypes) else CacheDtypes.uniform(dtype)
        geometries = {
            g.name: GroupGeometry.of(g, dtypes, page_size_tokens) for g in layer_map.groups
        }
        backend = backend or make_backend("cpu")
        try:
            if device_pools is not None:
                check_pools_device(device_pools, backend)
            else:
                device_pools = {
                    name: DevicePool.allocate(
                        geom,
                        device_pages if isinstance(device_pages, int) else device_pages[name],
                        backend.device,
                    )
                    for name, geom in geometries.items()
                }
            host_tier = HostTier.create(
                list(geometries.values()),
                host_capacity_bytes,
                host_layout,
                backend.alloc_host,
                pinned=backend.pins_host_memory,
                state_fraction=host_state_fraction,
                pages_per_group=host_pages_per_group,
            )
            scheduler = Scheduler(
                layer_map,
                backend,
                device_pools,
                host_tier,
                page_size_tokens=page_size_tokens,
                queue_depth=queue_depth,
                inflight_bytes=inflight_bytes,
                op_timeout_s=op_timeout_s,
                move_policy=move_policy,
                counter_ring_size=counter_ring_size,
                clock=clock,
            )
        except BaseException:
            backend.close()
            raise
        return cls(
            layer_map, geometries, backend, dict(device_pools), host_tier, scheduler, tp_rank
        )

    @classmethod
    def from_config(
        cls, loaded: LoadedConfig, *, clock: Clock | None = None, tp_rank: int | None = None
    ) -> EmbeddedCache:
        """The stack with device pools of its own (`device.pool_capacity_bytes`); at
        `model.tp_size` > 1, `tp_rank` says which rank's share it holds."""
        d = loaded.deployment
        return cls.from_deployment(d, loaded.layer_map(), clock=clock, tp_rank=tp_rank)

    @classmethod
    def from_deployment(
        cls,
        d: Deployment,
        layer_map: LayerMap,
        *,
        backend: CopyBackend | None = None,
        device_pools: Mapping[str, DevicePool] | None = None,
        clock: Clock | None = None,
        tp_rank: int | None = None,
    ) -> EmbeddedCache:
        """The stack a deployment describes, on a given copy backend and the engine's device
        pools when given (the sidecar shares one backend between namespaces)."""
        dtypes = CacheDtypes.of_model(d.model)
        geometries = [
            GroupGeometry.of(g, dtypes, d.model.page_size_tokens) for g in layer_map.groups
        ]
        per_page = sum(g.page_bytes for g in geometries)
        if backend is None:
            # bound to the pools' device when given (an engine's TP rank on its own GPU)
            where = pools_device(device_pools) if device_pools else None
            index = d.device.index if where is None or where.index is None else where.index
            backend = make_backend(d.device.kind, index, d.host.pin_chunk_bytes)
        return cls.build(
            layer_map,
            dtype=dtypes,
            page_size_tokens=d.model.page_size_tokens,
            host_capacity_bytes=d.host.capacity_bytes,
            device_pages=max(1, d.device.pool_capacity_bytes // per_page),
            host_layout=d.host.layout,
            host_state_fraction=d.host.state_fraction,
            backend=backend,
            device_pools=device_pools,
            queue_depth=d.scheduler.queue_depth,
            inflight_bytes=d.scheduler.inflight_bytes,
            op_timeout_s=d.scheduler.op_timeout_s,
            move_policy=d.scheduler.move_policy,
            counter_ring_size=d.scheduler.counter_ring_size,
            clock=clock,
            tp_rank=tp_rank,
        )

    def close(self) -> None:
        self.backend.close()
