"""`EmbeddedCache`: the whole in-process stack for one pipeline stage, built from plain
settings (`StackSettings`, which `hicache.assembly` reads from a deployment): layer map ->
geometries -> copy backend -> device pools (the engine's, or our own for the demo) -> host
tier -> scheduler.

Lifecycle: `EmbeddedCache.build(...)` (or `hicache.assembly.embedded_stack`) allocates
everything at start;
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

from hicache.errors import ConfigError
from hicache.memory import CacheDtypes, DevicePool, GroupGeometry, HostTier, group_geometries
from hicache.memory.host_pool import HostLayout
from hicache.model import LayerMap
from hicache.scheduler import Clock, MovePolicy, Scheduler
from hicache.transfer import CopyBackend


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


@dataclass(frozen=True, slots=True)
class StackSettings:
    """What a stack is built with: every value comes from the deployment's sections
    (`hicache.assembly.stack_settings`), none has a default here (the schema's are the only
    ones). `device_pages`: L1 pages per group the stack allocates when no engine gives pools
    (`device.pool_capacity_bytes` over the page bytes of all groups)."""

    dtypes: CacheDtypes
    page_size_tokens: int
    device_pages: int | Mapping[str, int]
    host_capacity_bytes: int
    host_layout: HostLayout
    host_state_fraction: float
    queue_depth: int
    inflight_bytes: int
    op_timeout_s: float
    move_policy: MovePolicy
    counter_ring_size: int


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
        settings: StackSettings,
        *,
        backend: CopyBackend,
        device_pools: Mapping[str, DevicePool] | None = None,
        host_pages_per_group: Mapping[str, int] | None = None,
        clock: Clock | None = None,
        tp_rank: int | None = None,
        host_tier: HostTier | None = None,
        owns_backend: bool = True,
    ) -> EmbeddedCache:
        """One stage of one tensor-parallel rank (`tp_rank` of the layout's tp_size: an
        embedded engine is one rank, its layer map that rank's share, `shard_layout`), on
        `backend` (closed here if the build fails, unless `owns_backend` is False: a backend
        the caller shares, as the sidecar's is by every namespace). `device_pools`: the
        engine's (else the stack allocates `settings.device_pages`); `host_pages_per_group`
        fixes L2's pages instead of dividing `settings.host_capacity_bytes` (tests);
        `host_tier`: an L2 built before, shared with other stacks of the same geometry
        (tenants sharing one L2, `cache.shares`), instead of one of its own."""
        device_pages = settings.device_pages
        try:
            tp_rank = rank_of(tp_rank, layer_map.layout.tp_size, "EmbeddedCache.build")
            geometries = group_geometries(
                layer_map.groups, settings.dtypes, settings.page_size_tokens
            )
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
            host_tier = host_tier or HostTier.create(
                list(geometries.values()),
                settings.host_capacity_bytes,
                settings.host_layout,
                backend.alloc_host,
                pinned=backend.pins_host_memory,
                state_fraction=settings.host_state_fraction,
                pages_per_group=host_pages_per_group,
            )
            scheduler = Scheduler(
                layer_map,
                backend,
                device_pools,
                host_tier,
                page_size_tokens=settings.page_size_tokens,
                queue_depth=settings.queue_depth,
                inflight_bytes=settings.inflight_bytes,
                op_timeout_s=settings.op_timeout_s,
                move_policy=settings.move_policy,
                counter_ring_size=settings.counter_ring_size,
                clock=clock,
            )
        except BaseException:
            if owns_backend:
                backend.close()
            raise
        return cls(
            layer_map, geometries, backend, dict(device_pools), host_tier, scheduler, tp_rank
        )

    def effective_settings(self) -> dict[str, object]:
        """What this stack runs with, read back from its parts (not from what it was built
        with), by the deployment key each comes from: the copy backend, L2's pools, the
        scheduler's limits."""
        pools = self.host_tier.pools
        scheduler = self.scheduler
        return {
            "model.tp_rank": self.tp_rank,
            "model.tp_size": self.tp_size,
            "model.groups": {
                n: (g.group.layer_ids, g.dtype_signature, g.page_bytes)
                for n, g in self.geometries.items()
            },
            "model.page_size_tokens": scheduler.page_size_tokens,
            "device.kind": self.backend.device.type,
            "host.pinned": self.backend.pins_host_memory,
            "host.prefault": getattr(self.backend, "prefault", True),
            "host.layout": {n: p.layout for n, p in pools.items()},
            "host.pages": {n: p.num_pages for n, p in pools.items()},
            "scheduler.queue_depth": scheduler.queue_depth,
            "scheduler.inflight_bytes": scheduler.inflight_bytes,
            "scheduler.op_timeout_s": scheduler.op_timeout_s,
            "scheduler.move_policy": scheduler.move_policy,
            "scheduler.counter_ring_size": scheduler.counter_ring_size,
        }

    def close(self) -> None:
        self.backend.close()
