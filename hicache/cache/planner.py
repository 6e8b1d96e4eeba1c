"""`Planner`: the pure half of the tier core. Every decision that touches the index or a host
pool's allocator is taken here, synchronously — no awaits, no torch — so nothing another
coroutine does can slip between a decision and its reservation.

Lifecycle of each op (its executor, `stores.py` or `loads.py`, awaits only between the steps):

    store:  write_back_victims -> [persist them] -> evict_victims   (only when room costs a
                                                                     page L3 should have)
            plan_store -> [backup L1 -> L2] -> commit_store | abort_store
    fetch:  plan_fetch -> [L3 read into the reserved pages] -> commit_fetch | abort_fetch
            (pages not indexed are freed, and an abort happens, only once the read has
            settled: a read that timed out may still be writing them)
    load:   plan_load (lookup, touch and pin in one step) -> [copies] -> release_load

A plan owns exactly what it reserved: host pages it allocated, index pins, and *pending*
keys — keys being stored or fetched, which every other plan skips, so two stores of one
prefix never both back it up and a fetch never takes a page a store is filling. A store
plan names the keys it skipped because another store holds them (`StorePlan.waits`): its
executor acknowledges only once those have settled, and stores again what the other store
did not (it failed, or its engine died). Commit
publishes a plan to the index once; abort gives back everything once; a second call of
either is an error (`PlanStateError`). Victims are never pinned, pending, or pages a copy
still reads (allocator pins). A store that does not fit L2 keeps its longest prefix that
does (`StorePlan.truncated_to_pages`) instead of failing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from hicache.errors import HicacheError
from hicache.index import Hit, PageKey, PageRecord, PrefixIndex, WritePolicy
from hicache.memory.page_allocator import AllocatorStats

if TYPE_CHECKING:
    from hicache.cache.shares import L2Shares


class PoolPages(Protocol):
    """What the planner asks of a host pool's allocator: a `PageAllocator`, or a tenant's
    view of a shared one (`cache.shares.TenantPages`)."""

    def alloc(self, count: int) -> list[int]: ...
    def free(self, pages: Iterable[int]) -> None: ...
    def is_pinned(self, page: int) -> bool: ...
    def is_allocated(self, page: int) -> bool: ...
    def check(self) -> None: ...
    def stats(self) -> AllocatorStats: ...


class PlanStateError(HicacheError, RuntimeError):
    """A plan was committed or aborted twice (a bug in the executor, never the engine's)."""


class PlanState(StrEnum):
    PLANNED = "planned"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(slots=True)
class _Plan:
    state: PlanState = PlanState.PLANNED

    def _close(self, to: PlanState) -> None:
        if self.state is not PlanState.PLANNED:
            raise PlanStateError(f"{type(self).__name__} is {self.state.value}; cannot {to.value}")
        self.state = to


@dataclass(slots=True)
class GroupStore:
    positions: list[int]  # page positions in the prompt (a state group: its snapshot's page)
    device_pages: list[int]
    keys: list[PageKey]
    host_pages: list[int]


@dataclass(slots=True)
class StorePlan(_Plan):
    groups: dict[str, GroupStore] = field(default_factory=dict)
    evicted: int = 0
    truncated_to_pages: int | None = None  # the prompt's longest prefix that fit L2
    # wanted keys another store is backing up now (pending, not yet indexed): this store
    # leaves them to it, and its caller waits for that store's end before acknowledging
    waits: dict[str, frozenset[PageKey]] = field(default_factory=dict)


@dataclass(slots=True)
class GroupFetch:
    records: list[PageRecord]
    host_pages: list[int]


@dataclass(slots=True)
class FetchPlan(_Plan):
    groups: dict[str, GroupFetch] = field(default_factory=dict)
    evicted: int = 0


@dataclass(slots=True)
class LoadPlan(_Plan):
    hit: Hit = field(default_factory=lambda: Hit(1, 0, 0))
    pinned: dict[str, list[PageKey]] = field(default_factory=dict)
    hot: dict[str, list[PageRecord]] = field(default_factory=dict)  # selective write-through


class Planner:
    def __init__(
        self,
        index: PrefixIndex,
        allocators: Mapping[str, PoolPages],
        write_policy: WritePolicy,
        written_elsewhere: frozenset[str] = frozenset(),
    ):
        self.index = index
        self.allocators: dict[str, PoolPages] = dict(allocators)
        # an L2 shared with other tenants (`cache.shares`, joined after build): room beyond
        # the free pages comes from its eviction rule, not only from this index
        self.shares: L2Shares | None = None
        self.tenant: str | None = None
        self.write_policy = write_policy
        # groups another rank writes to L3 (a replicated group on a tensor-parallel rank
        # other than 0): never dirty here, so an eviction never waits to write them
        self.written_elsewhere = written_elsewhere
        self.pending: dict[str, set[PageKey]] = {g: set() for g in index.rules}
        # pages L3 is owed but does not have yet (queued behind an acked store): evicting
        # one would lose it for L3 as well, so it is persisted first, like write-back's
        self.owed: Callable[[str, PageRecord], bool] = lambda group, record: False
        # told whenever a store plan is committed or aborted (its pending keys are settled)
        self.store_ended: Callable[[], None] = lambda: None
        self._orphans: list[StorePlan] = []  # aborted while a copy may still write them

    # ---- victims --------------------------------------------------------------------------

    def _evictable(
        self, group: str, clean_only: bool, protect: frozenset[PageKey] = frozenset()
    ) -> Callable[[PageRecord], bool]:
        allocator, pending = self.allocators[group], self.pending[group]

        def can_evict(record: PageRecord) -> bool:
            return (
                record.pins == 0
                and record.key not in pending
                and record.key not in protect
                and record.l2_page is not None
                and not allocator.is_pinned(record.l2_page)
                and not (clean_only and self._dirty(group, record))
            )

        return can_evict

    def _dirty(self, group: str, record: PageRecord) -> bool:
        """L3 should have this page first: the write policy says so (write-back), or a
        write behind an acked store has not happened yet. Never for a group another rank
        writes."""
        if record.in_l3 or group in self.written_elsewhere:
            return False
        return self.write_policy.on_evict(record) or self.owed(group, record)

    def _victims(
        self,
        group: str,
        count: int,
        clean_only: bool,
        protect: frozenset[PageKey] = frozenset(),
    ) -> list[PageRecord]:
        if count <= 0:
            return []
        return self.index.l2_victims(group, count, self._evictable(group, clean_only, protect))

    def _evict(self, group: str, victims: Sequence[PageRecord]) -> int:
        return self.evict_for(group, victims, self)

    def own_victims(
        self, group: str, count: int, clean_only: bool, protect: frozenset[PageKey]
    ) -> list[PageRecord]:
        """This index's victims as this planner judges them (what another tenant sharing
        the L2 may take of it: clean, unpinned, not pending)."""
        return self._victims(group, count, clean_only, protect)

    def evict_for(self, group: str, victims: Sequence[PageRecord], by: Planner) -> int:
        """Evict `victims` of this index (to make room for `by`: this planner, or another
        tenant's sharing the L2); returns how many."""
        allocator = self.allocators[group]
        freed = [self.index.drop_l2(group, v.key) for v in victims]
        allocator.free(freed)
        if self.shares is not None and self.tenant is not None and freed:
            self.shares.counted_eviction(self.tenant, by.tenant or "", group, len(freed))
        return len(freed)

    def _room(
        self, group: str, count: int, clean_only: bool, protect: frozenset[PageKey]
    ) -> list[tuple[Planner, PageRecord]]:
        """Victims whose eviction gives this planner `count` more pages: its own, or, on an
        L2 shared with other tenants, as `L2Shares.victims` rules."""
        if count <= 0:
            return []
        if self.shares is not None and self.tenant is not None:
            return self.shares.victims(self.tenant, group, count, clean_only, protect)
        return [(self, r) for r in self._victims(group, count, clean_only, protect)]

    def _evict_room(self, group: str, victims: Sequence[tuple[Planner, PageRecord]]) -> int:
        per: dict[int, tuple[Planner, list[PageRecord]]] = {}
        for planner, record in victims:
            per.setdefault(id(planner), (planner, []))[1].append(record)
        return sum(p.evict_for(group, records, self) for p, records in per.values())

    def store_needs(
        self, keys: Mapping[str, Sequence[PageKey]], wanted: Mapping[str, Sequence[tuple[int, int]]]
    ) -> dict[str, int]:
        """How many new pages a store wants per group: not in the index, not pending."""
        return {
            group: sum(
                1
                for i, _ in pairs
                if keys[group][i] not in self.pending[group]
                and self.index.record(group, keys[group][i]) is None
            )
            for group, pairs in wanted.items()
        }

    def write_back_victims(
        self, needs: Mapping[str, int], protect: Mapping[str, frozenset[PageKey]] | None = None
    ) -> dict[str, list[PageRecord]]:
        """The victims making room for `needs[group]` new pages would cost that L3 should
        have first (write-back's, or owed by a write behind an acked store), pinned until
        `evict_victims`."""
        out: dict[str, list[PageRecord]] = {}
        for group, need in needs.items():
            short = need - self.allocators[group].stats().free_pages
            own = (protect or {}).get(group, frozenset())
            # on a shared L2 only this tenant's own victims of the rule are its to persist
            victims = [r for p, r in self._room(group, short, False, own) if p is self]
            dirty = [v for v in victims if self._dirty(group, v)]
            if dirty:
                self.index.pin(group, [v.key for v in dirty])
                out[group] = dirty
        return out

    def evict_victims(self, victims: Mapping[str, Sequence[PageRecord]]) -> int:
        """Unpin what `write_back_victims` pinned and evict those nothing else holds now
        (persisted or not: L2 is a cache, and a write-back persist that failed must not fill
        it for good)."""
        evicted = 0
        for group, records in victims.items():
            self.index.unpin(group, [r.key for r in records])
            current = [self.index.record(group, r.key) for r in records]
            gone = [r for r in current if r is not None and self._evictable(group, False)(r)]
            evicted += self._evict(group, gone)
        return evicted

    # ---- store ----------------------------------------------------------------------------

    def plan_store(
        self, keys: Mapping[str, Sequence[PageKey]], wanted: Mapping[str, Sequence[tuple[int, int]]]
    ) -> StorePlan:
        """Reserve host pages for the `wanted` (position, device page) pairs the index lacks:
        evict clean victims, allocate, mark the keys pending. Positions from the first one
        that does not fit in some group on are dropped in every group: the longest prefix
        that fits is stored."""
        self.sweep()
        fresh: dict[str, list[tuple[int, int]]] = {}
        # the prompt's own pages are never room for its others: a longer prompt whose
        # prefix is cached keeps the prefix, and stores the longest extension that fits
        own = {group: frozenset(group_keys) for group, group_keys in keys.items()}
        limit: int | None = None
        waits: dict[str, frozenset[PageKey]] = {}
        for group, pairs in wanted.items():
            pending, group_keys = self.pending[group], keys[group]
            unknown = [(i, d) for i, d in pairs if self.index.record(group, group_keys[i]) is None]
            todo = [(i, d) for i, d in unknown if group_keys[i] not in pending]
            if len(todo) < len(unknown):  # another store holds these: stored once, by it
                waits[group] = frozenset(group_keys[i] for i, _ in unknown) & pending
            free = self.allocators[group].stats().free_pages
            room = free + len(self._room(group, len(todo) - free, True, own[group]))
            if len(todo) > room:
                cut = todo[room][0]
                limit = cut if limit is None else min(limit, cut)
            fresh[group] = todo
        plan = StorePlan(truncated_to_pages=limit, waits=waits)
        for group, todo in fresh.items():
            if limit is not None:
                todo = [(i, d) for i, d in todo if i < limit]
            if not todo:
                continue
            allocator = self.allocators[group]
            short = len(todo) - allocator.stats().free_pages
            plan.evicted += self._evict_room(group, self._room(group, short, True, own[group]))
            run = allocator.alloc(len(todo))
            # the run handed out in device-page order: the backup is then one gather
            order = sorted(range(len(todo)), key=lambda j: todo[j][1])
            host = [0] * len(todo)
            for rank, j in enumerate(order):
                host[j] = run[rank]
            group_keys = [keys[group][i] for i, _ in todo]
            self.pending[group].update(group_keys)
            plan.groups[group] = GroupStore(
                [i for i, _ in todo], [d for _, d in todo], group_keys, host
            )
        return plan

    def commit_store(self, plan: StorePlan) -> dict[str, list[PageRecord]]:
        """The backup landed: index its pages (the host pages pass to the index)."""
        plan._close(PlanState.COMMITTED)
        out: dict[str, list[PageRecord]] = {}
        for group, g in plan.groups.items():
            self.pending[group].difference_update(g.keys)
            out[group] = [
                self.index.insert_l2(group, key, page)
                for key, page in zip(g.keys, g.host_pages, strict=True)
            ]
        self.store_ended()
        return out

    def still_pending(self, waits: Mapping[str, frozenset[PageKey]]) -> bool:
        """Is some key of a plan's `waits` still being stored by another plan?"""
        return any(keys & self.pending[group] for group, keys in waits.items())

    def abort_store_later(self, plan: StorePlan) -> None:
        """Abort once no copy writes the plan's pages (their allocator pins are gone): the
        caller left while the backup's walk may have started."""
        self._orphans.append(plan)
        self.sweep()

    def sweep(self) -> int:
        """Abort the orphaned plans whose copies have ended; returns how many are left."""
        for plan in list(self._orphans):
            if not any(
                self.allocators[group].is_pinned(page)
                for group, g in plan.groups.items()
                for page in g.host_pages
            ):
                self._orphans.remove(plan)
                self.abort_store(plan)
        return len(self._orphans)

    def abort_store(self, plan: StorePlan) -> None:
        """The backup failed or was cancelled, and has ended: give everything back."""
        plan._close(PlanState.ABORTED)
        for group, g in plan.groups.items():
            self.pending[group].difference_update(g.keys)
            self.allocators[group].free(g.host_pages)
        self.store_ended()

    # ---- fetch (L3 -> L2) -------------------------------------------------------------------

    def fetch_short(self, hit: Hit) -> bool:
        """Are some of the hit's L3-only pages neither in L2 nor reserved by a fetch?"""
        return any(
            r.l2_page is None and r.in_l3 and r.key not in self.pending[group]
            for group, rows in hit.needed.items()
            for _, r in rows
        )

    def plan_fetch(self, hit: Hit, into: FetchPlan | None = None) -> FetchPlan:
        """Reserve host pages for the hit's pages only L3 holds (as many as fit), pinning
        their records so the index cannot forget them meanwhile. The hit's own L2 pages are
        never victims: room for half a prefix bought with its other half serves nothing."""
        plan = FetchPlan() if into is None else into
        for group, rows in hit.needed.items():
            pending = self.pending[group]
            protect = frozenset(r.key for _, r in rows if r.l2_page is not None)
            missing = [
                r
                for _, r in rows
                if r.l2_page is None
                and r.in_l3
                and r.key not in pending
                and self.index.record(group, r.key) is r  # not forgotten meanwhile
            ]
            if not missing:
                continue
            allocator = self.allocators[group]
            free = allocator.stats().free_pages
            victims = self._room(group, len(missing) - free, True, protect)
            take = missing[: free + len(victims)]
            if not take:
                continue
            keys = [r.key for r in take]
            self.index.pin(group, keys)  # first: evicting turns L2 pages into L3-only records,
            # and the bound on those may forget any unpinned one
            plan.evicted += self._evict_room(group, victims[: max(0, len(take) - free)])
            pages = allocator.alloc(len(take))
            pending.update(keys)
            g = plan.groups.setdefault(group, GroupFetch([], []))
            g.records.extend(take)
            g.host_pages.extend(pages)
        return plan

    def commit_fetch(
        self,
        plan: FetchPlan,
        ok: Mapping[str, Sequence[bool]],
        answered: Mapping[str, Sequence[bool]],
    ) -> tuple[int, dict[str, list[int]]]:
        """The read returned: index the pages that verified (their reads have finished); an
        object L3 answered for but could not give is stale in the index. Returns the pages L2
        gained, and the host pages not indexed — still allocated, because a read that timed
        out may still write them: the caller frees them (`free_pages`) once the fetch has
        settled."""
        plan._close(PlanState.COMMITTED)
        gained, leftover = 0, dict[str, list[int]]()
        for group, g in plan.groups.items():
            keys = [r.key for r in g.records]
            self.pending[group].difference_update(keys)
            goods = ok.get(group, [False] * len(g.records))
            answers = answered.get(group, [False] * len(g.records))
            rows = zip(g.records, g.host_pages, goods, answers, strict=True)
            for record, page, good, answer in rows:
                current = self.index.record(group, record.key)
                if good and current is not None and current.l2_page is None:
                    self.index.insert_l2(group, record.key, page)
                    gained += 1
                    continue
                leftover.setdefault(group, []).append(page)
                if not good and answer and current is not None and current.in_l3:
                    self.index.drop_l3(group, record.key)
            self.index.unpin(group, keys)
        return gained, leftover

    def free_pages(self, pages: Mapping[str, Sequence[int]]) -> None:
        """Give back host pages a settled fetch left unindexed."""
        for group, group_pages in pages.items():
            self.allocators[group].free(group_pages)

    def abort_fetch(self, plan: FetchPlan) -> None:
        """The read failed or was cancelled, and no thread writes its pages any more (the
        fetch settled, or never started): free it all."""
        plan._close(PlanState.ABORTED)
        for group, g in plan.groups.items():
            keys = [r.key for r in g.records]
            self.pending[group].difference_update(keys)
            self.allocators[group].free(g.host_pages)
            self.index.unpin(group, keys)

    # ---- load (L2 -> L1) --------------------------------------------------------------------

    def plan_load(
        self,
        prompt: Mapping[str, Sequence[PageKey]],
        skip_pages: int,
        groups: Collection[str] | None = None,
    ) -> LoadPlan:
        """The L2 hit now of the prompt given by its page keys (of `groups` alone: None,
        all), its records pinned in the same step (no eviction can come between the hit and
        the pins), and hits counted: only loads count, never lookups."""
        hit = self.index.lookup_keys(prompt, touch=False, skip_pages=skip_pages, groups=groups)
        pages, size = hit.pages_l2, hit.page_size_tokens
        named = {g: k for g, k in prompt.items() if groups is None or g in groups}
        keys = named if pages > skip_pages else {}
        needed: dict[str, tuple[tuple[int, PageRecord], ...]] = {}
        for group, group_keys in keys.items():
            rows: list[tuple[int, PageRecord]] = []
            for i in self.index.rules[group].needed(pages, size):
                if i < skip_pages:
                    continue
                record = self.index.record(group, group_keys[i])
                if record is None or record.l2_page is None:  # the index's own invariant
                    raise PlanStateError(
                        f"group {group!r}: page {i} of an L2 hit of {pages} pages is not in L2"
                    )
                rows.append((i, record))
            needed[group] = tuple(rows)
        plan = LoadPlan(hit=Hit(size, pages, pages, needed))
        for group, loaded in needed.items():
            group_keys = [r.key for _, r in loaded]
            self.index.pin(group, group_keys)
            plan.pinned[group] = group_keys
            self.index.touch(group, [r for _, r in loaded])
            hot = [r for _, r in loaded if self.write_policy.on_hit(r)]
            if hot:
                plan.hot[group] = hot
        return plan

    def release_load(self, plan: LoadPlan) -> None:
        """The load's copies ended (or it never started): its records may go."""
        plan._close(PlanState.COMMITTED)
        for group, keys in plan.pinned.items():
            self.index.unpin(group, keys)

    def forget_l3(self) -> int:
        """L3 was detached or replaced: nothing the index knew of the old store holds for the
        new one. Every record's L3 mark is dropped (an L3-only record goes, a pinned one at
        its last unpin: a fetch in flight still commits what it verified into L2); the new
        store is asked again at lookup (discovery). Returns how many marks were dropped."""
        dropped = 0
        for group in self.index.rules:
            for record in self.index.l3_records(group):
                self.index.drop_l3(group, record.key)
                dropped += 1
        return dropped

    def evict_all(self) -> int:
        """Drop every L2 page nothing holds (pins, pending plans, copies): the admin API."""
        dropped = 0
        for group in self.index.rules:
            can_evict = self._evictable(group, False)
            dropped += self._evict(group, [r for r in self.index.l2_records(group) if can_evict(r)])
        return dropped

    # ---- checks (tests) ---------------------------------------------------------------------

    def check(self) -> None:
        """Invariants: the index and every allocator agree page for page."""
        for group, allocator in self.allocators.items():
            allocator.check()
            in_index = [r.l2_page for r in self.index.l2_records(group)]
            assert len(set(in_index)) == len(in_index), f"{group}: an L2 page indexed twice"
            assert all(allocator.is_allocated(p) for p in in_index if p is not None), group
