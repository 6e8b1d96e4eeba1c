"""`L2Shares`: one L2 (a host tier) shared by the tenants of one tensor-parallel rank, each
listed tenant guaranteed a share of it, the others sharing the rest.

Who holds what: every tenant's namespace keeps its own index and planner over the one host
tier; each planner allocates through a `TenantPages` view of a pool's allocator, which counts
the pages that tenant holds (indexed or reserved by a plan in flight). A *holder* is a listed
tenant, or `REST`: every tenant the deployment does not list, together.

The eviction rule (`victims`), when tenant T needs k pages beyond the free ones in a group:
1. pages of holders over their guaranteed share, at most each one's excess (T's own holder
   included when it is over), least recently used first across them;
2. then pages of T's own holder (T itself, or the other unlisted tenants when T is one of
   them), least recently used first;
never a page of another holder at or under its share. A holder at its cap (`l2_cap`) gets
room only from its own pages. Other tenants' pages are taken only when clean (L3 has them or
needs none), unpinned and not pending, as their own planner would judge them; a store that
still does not fit keeps its longest prefix that does (`Planner.plan_store`). Recency is one
clock across the indexes (`PageRecord.used`), so with no shares listed the tenants share one
least-recently-used order, as one L2 without shares would.

Lifecycle: built per tp_rank by the first namespace of that rank (`assembly`), holding the
host tier that namespace allocated -> each namespace's planner `join`s under its tenant (its
allocators replaced by views, its `room` by `victims`) -> lives as long as the service.
Everything here runs on the service's event loop, synchronously, like the planners it
arbitrates: no decision is split by an await.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hicache.index import PageKey, PageRecord
from hicache.memory import HostTier
from hicache.memory.page_allocator import AllocatorStats, PageAllocator

if TYPE_CHECKING:
    from hicache.cache.planner import Planner

REST = "*"  # the holder of every tenant the deployment does not list


@dataclass(frozen=True, slots=True)
class ShareRule:
    """A holder's part of L2, as fractions of each group's pages."""

    share: float  # guaranteed
    cap: float = 1.0  # the most it may hold


@dataclass(frozen=True, slots=True)
class TenantGroupStats:
    held_pages: int  # allocated to this tenant: indexed, or reserved by a plan in flight
    share_pages: int  # its holder's guaranteed pages
    cap_pages: int  # the most its holder may hold
    evicted_pages: int  # its pages evicted, by its own stores and fetches or others'
    evicted_by_others_pages: int  # of those, evicted to make room for another tenant


@dataclass
class _Member:
    planner: Planner
    held: dict[str, int] = field(default_factory=dict)


class TenantPages:
    """A tenant's view of a shared pool's allocator: allocations and frees counted as its
    own; `stats().free_pages` is what it may take without evicting (the pool's free pages,
    at most what its holder's cap leaves)."""

    def __init__(self, shares: L2Shares, tenant: str, group: str, shared: PageAllocator):
        self._shares, self._tenant, self._group, self._shared = shares, tenant, group, shared

    def alloc(self, count: int) -> list[int]:
        pages = self._shared.alloc(count)
        self._shares._held(self._tenant)[self._group] += len(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        self._shared.free(pages)
        self._shares._held(self._tenant)[self._group] -= len(pages)

    def pin(self, pages: Iterable[int]) -> None:
        self._shared.pin(pages)

    def unpin(self, pages: Iterable[int]) -> None:
        self._shared.unpin(pages)

    def is_allocated(self, page: int) -> bool:
        return self._shared.is_allocated(page)

    def is_pinned(self, page: int) -> bool:
        return self._shared.is_pinned(page)

    def check(self) -> None:
        self._shared.check()
        assert 0 <= self.held_pages <= self._shared.num_pages, (self._tenant, self.held_pages)

    @property
    def held_pages(self) -> int:
        return self._shares._held(self._tenant)[self._group]

    def stats(self) -> AllocatorStats:
        shared = self._shared.stats()
        free = min(shared.free_pages, self._shares.cap_room(self._tenant, self._group))
        return AllocatorStats(shared.num_pages, max(0, free), shared.pinned_pages)


class L2Shares:
    def __init__(self, host_tier: HostTier, listed: Mapping[str, ShareRule], rest: ShareRule):
        self.host_tier = host_tier
        self.rules: dict[str, ShareRule] = {**listed, REST: rest}
        self._members: dict[str, _Member] = {}
        self.evicted: dict[str, dict[str, int]] = {}
        self.evicted_by_others: dict[str, dict[str, int]] = {}

    # ---- membership ------------------------------------------------------------------------

    def holder(self, tenant: str) -> str:
        return tenant if tenant in self.rules and tenant != REST else REST

    def join(self, tenant: str, planner: Planner) -> None:
        """Serve `tenant`'s planner from the shared tier: its allocators become views, its
        room the rule above."""
        if tenant in self._members:
            raise ValueError(f"tenant {tenant!r} already shares this L2")
        groups = list(planner.allocators)
        self._members[tenant] = _Member(planner, {g: 0 for g in groups})
        self.evicted[tenant] = {g: 0 for g in groups}
        self.evicted_by_others[tenant] = {g: 0 for g in groups}
        planner.allocators = {
            g: TenantPages(self, tenant, g, self.host_tier.pool(g).allocator) for g in groups
        }
        planner.shares = self
        planner.tenant = tenant

    def _held(self, tenant: str) -> dict[str, int]:
        return self._members[tenant].held

    def tenants(self) -> list[str]:
        return sorted(self._members)

    # ---- pages -----------------------------------------------------------------------------

    def holder_pages(self, holder: str, group: str) -> int:
        return sum(m.held[group] for t, m in self._members.items() if self.holder(t) == holder)

    def share_pages(self, holder: str, group: str) -> int:
        return math.floor(self.rules[holder].share * self.host_tier.pool(group).num_pages)

    def cap_pages(self, holder: str, group: str) -> int:
        return math.floor(self.rules[holder].cap * self.host_tier.pool(group).num_pages)

    def cap_room(self, tenant: str, group: str) -> int:
        """Pages `tenant` may still add before its holder reaches its cap."""
        holder = self.holder(tenant)
        return self.cap_pages(holder, group) - self.holder_pages(holder, group)

    def counted_eviction(self, tenant: str, by: str, group: str, pages: int) -> None:
        self.evicted[tenant][group] += pages
        if by != tenant:
            self.evicted_by_others[tenant][group] += pages

    # ---- the eviction rule -----------------------------------------------------------------

    def victims(
        self,
        tenant: str,
        group: str,
        count: int,
        clean_only: bool,
        protect: frozenset[PageKey],
    ) -> list[tuple[Planner, PageRecord]]:
        """Up to `count` pages to evict so that `tenant` can take as many more (module
        docstring); none evicted yet."""
        if count <= 0:
            return []
        mine = self.holder(tenant)
        shared_free = self.host_tier.pool(group).allocator.stats().free_pages
        # another holder's page frees a pool page but not cap room: useful only up to the cap
        foreign_useful = max(0, self.cap_room(tenant, group) - shared_free)
        taken: list[tuple[Planner, PageRecord]] = []
        seen: set[int] = set()
        over = {
            h: self.holder_pages(h, group) - self.share_pages(h, group)
            for h in self.rules
            if h == mine or foreign_useful > 0
        }
        limits = {h: excess for h, excess in over.items() if excess > 0}
        if limits:
            self._take(tenant, group, limits, count, clean_only, protect, taken, seen)
        if len(taken) < count:
            self._take(tenant, group, {mine: count}, count, clean_only, protect, taken, seen)
        return taken

    def _take(
        self,
        tenant: str,
        group: str,
        limits: dict[str, int],
        count: int,
        clean_only: bool,
        protect: frozenset[PageKey],
        taken: list[tuple[Planner, PageRecord]],
        seen: set[int],
    ) -> None:
        mine = self.holder(tenant)
        shared_free = self.host_tier.pool(group).allocator.stats().free_pages
        foreign_left = max(0, self.cap_room(tenant, group) - shared_free) - sum(
            1 for p, _ in taken if p.tenant is not None and self.holder(p.tenant) != mine
        )
        candidates: list[tuple[int, str, Planner, PageRecord]] = []
        for other, member in self._members.items():
            holder = self.holder(other)
            if holder not in limits:
                continue
            own = other == tenant
            want = min(limits[holder], count) + len(taken)
            records = member.planner.own_victims(
                group, want, clean_only if own else True, protect if own else frozenset()
            )
            candidates.extend((r.used, holder, member.planner, r) for r in records)
        candidates.sort(key=lambda c: c[0])
        used = dict.fromkeys(limits, 0)
        for _, holder, planner, record in candidates:
            if len(taken) >= count:
                break
            if id(record) in seen or used[holder] >= limits[holder]:
                continue
            if holder != mine:
                if foreign_left <= 0:
                    continue
                foreign_left -= 1
            seen.add(id(record))
            used[holder] += 1
            taken.append((planner, record))

    # ---- stats -----------------------------------------------------------------------------

    def stats(self) -> dict[str, dict[str, TenantGroupStats]]:
        """Per tenant sharing this L2, per group: what it holds, its holder's share and cap,
        and its pages evicted."""
        out: dict[str, dict[str, TenantGroupStats]] = {}
        for tenant, member in sorted(self._members.items()):
            holder = self.holder(tenant)
            out[tenant] = {
                g: TenantGroupStats(
                    held_pages=held,
                    share_pages=self.share_pages(holder, g),
                    cap_pages=self.cap_pages(holder, g),
                    evicted_pages=self.evicted[tenant][g],
                    evicted_by_others_pages=self.evicted_by_others[tenant][g],
                )
                for g, held in member.held.items()
            }
        return out
