"""`HostTier`: the L2 tier, one `HostPool` per cache group, sized from one byte budget.

Sizing by need: token groups (full, sliding, chunked, sparse) are budgeted in tokens — every
token group the same page count, as many as their share of `capacity_bytes` holds of one page
across them, so a prefix that fits one fits all — and state groups (linear, Mamba, conv) in
snapshots — every state group the same count, from `state_fraction` of the budget. One state
snapshot of a large hybrid costs as much as a hundred KV pages or more (Qwen3-Next-80B: ~40
MiB against ~0.4 MiB per 16-token page), so equal page counts spent almost all of L2 on
snapshots. A model with one kind of group gives it the whole budget. `pages_per_group` sets
every count explicitly instead (tests, and engines that size it themselves).

Start-up allocates each buffer through the copy backend (pinned when CUDA is present,
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
    pages_per_group: Mapping[str, int]
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
            f"{format_bytes(self.capacity_bytes)} budget; pages per group: "
            + ", ".join(f"{g} {n}" for g, n in sorted(self.pages_per_group.items())),
            f"pinned: {self.pinned}, allocation + prefault took {self.allocate_s:.3f}s, "
            f"memlock limit: {limit}",
        ]


def budget_pages(
    geometries: list[GroupGeometry], capacity_bytes: int, state_fraction: float
) -> dict[str, int]:
    """Pages per group from one byte budget: token groups by tokens, state groups by
    snapshots (see the module docstring). Refuses a budget that holds no page of a group,
    naming what one costs."""
    if not 0 < state_fraction < 1:
        raise ConfigError(
            f"host.state_fraction {state_fraction} is outside (0, 1): the share of "
            "host.capacity_bytes for state snapshots"
        )
    tokens = [g for g in geometries if g.group.kind.is_token_cache]
    states = [g for g in geometries if not g.group.kind.is_token_cache]
    shares = {"token": 1.0, "state": 1.0}
    if tokens and states:
        shares = {"token": 1.0 - state_fraction, "state": state_fraction}
    counts: dict[str, int] = {}
    for kind, members in (("token", tokens), ("state", states)):
        if not members:
            continue
        per_page = sum(g.page_bytes for g in members)
        budget = int(capacity_bytes * shares[kind])
        pages = budget // per_page
        if pages < 1:
            what = "one page" if kind == "token" else "one snapshot"
            need = -(-per_page // shares[kind]) if shares[kind] < 1 else per_page
            raise ConfigError(
                f"host.capacity_bytes {format_bytes(capacity_bytes)} cannot hold {what} of the "
                f"{kind} groups ({', '.join(sorted(g.name for g in members))}: "
                f"{format_bytes(per_page)}, {format_bytes(budget)} budgeted for them); "
                f"allowed: at least {format_bytes(int(need))}"
                + (" (or a larger host.state_fraction)" if kind == "state" and tokens else "")
            )
        counts.update({g.name: pages for g in members})
    return counts


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
        state_fraction: float = 0.25,
        pages_per_group: Mapping[str, int] | None = None,
    ) -> HostTier:
        counts = (
            dict(pages_per_group)
            if pages_per_group is not None
            else budget_pages(geometries, capacity_bytes, state_fraction)
        )
        started = time.perf_counter()
        pools = {
            g.name: HostPool(g, counts[g.name], layout, allocate(counts[g.name] * g.page_bytes))
            for g in geometries
        }
        report = HostTierReport(
            capacity_bytes=capacity_bytes,
            allocated_bytes=sum(p.nbytes for p in pools.values()),
            pages_per_group=counts,
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
