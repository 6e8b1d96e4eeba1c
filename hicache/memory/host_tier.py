"""`HostTier`: the L2 tier, one `HostPool` per cache group, sized from one byte budget.

Sizing: every group gets the same number of pages, as many as `capacity_bytes` holds of one
page across all groups, so a prefix that fits one group fits all (a hybrid hit needs every
group). Start-up allocates each buffer through the copy backend (pinned when CUDA is present,
registered in chunks), prefaults it, and reports memlock limits and the time pinning took.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from hicache.config.sizes import format_bytes
from hicache.errors import ConfigError
from hicache.memory.geometry import GroupGeometry
from hicache.memory.host_pool import HostLayout, HostPool

HostAllocator = Callable[[int], torch.Tensor]  # nbytes -> 1-D uint8 buffer, prefaulted


@dataclass(frozen=True, slots=True)
class HostTierReport:
    capacity_bytes: int
    allocated_bytes: int
    pages_per_group: int
    pinned: bool
    allocate_s: float
    memlock_limit_bytes: int | None  # None: unlimited

    def lines(self) -> list[str]:
        limit = (
            "unlimited"
            if self.memlock_limit_bytes is None
            else format_bytes(self.memlock_limit_bytes)
        )
        return [
            f"host tier: {format_bytes(self.allocated_bytes)} of "
            f"{format_bytes(self.capacity_bytes)} budget, {self.pages_per_group} pages per group",
            f"pinned: {self.pinned}, allocation + prefault took {self.allocate_s:.3f}s, "
            f"memlock limit: {limit}",
        ]


def memlock_limit_bytes() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


class HostTier:
    def __init__(self, pools: Mapping[str, HostPool], report: HostTierReport):
        self.pools = dict(pools)
        self.report = report

    @classmethod
    def create(
        cls,
        geometries: list[GroupGeometry],
        capacity_bytes: int,
        layout: HostLayout,
        allocate: HostAllocator,
        *,
        pinned: bool = False,
    ) -> HostTier:
        per_page = sum(g.page_bytes for g in geometries)
        pages = capacity_bytes // per_page if per_page else 0
        if pages < 1:
            raise ConfigError(
                f"host.capacity_bytes {format_bytes(capacity_bytes)} cannot hold one page across "
                f"all cache groups ({format_bytes(per_page)}); raise it or lower "
                "model.page_size_tokens"
            )
        started = time.perf_counter()
        pools = {
            g.name: HostPool(g, pages, layout, allocate(pages * g.page_bytes)) for g in geometries
        }
        report = HostTierReport(
            capacity_bytes=capacity_bytes,
            allocated_bytes=sum(p.nbytes for p in pools.values()),
            pages_per_group=pages,
            pinned=pinned,
            allocate_s=time.perf_counter() - started,
            memlock_limit_bytes=memlock_limit_bytes(),
        )
        return cls(pools, report)

    def pool(self, group: str) -> HostPool:
        return self.pools[group]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values())
