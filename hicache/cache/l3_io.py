"""`L3Io`: the executor's half that moves bytes between L2 host pages and L3 — writes of
indexed pages (the persist worker, write-back victims, the flush) and reads into pages a
`FetchPlan` reserved — with the rule that a host page is never reused while a backend thread
may still touch it.

Writes pin their records while L3 reads the pages and mark them in L3 once acknowledged.
Reads index what verified as soon as the fetch returns; the other pages, and a cancelled
fetch's, are given back only once the fetch has *settled* (a read that timed out is never
cancelled on its thread). `settle()` waits for those, bounded, at shutdown. Each read is
timed: `read_rate` (L3's bytes per second, `read_rate.py`) and `reading_bytes` (what L3 is
reading now, for fetches ahead of a new one) size the auto prefetch deadline.

L3 may be swapped under an op (`TieredCache.attach_l3`: detached, or replaced by another
store). An op finishes on the store it started on, but what that store says is recorded only
while it is still the attached one (`current()`): a write it acknowledges afterwards is not
marked in L3, an "absent" answer drops nothing, its timing is not the new store's rate. The
bytes a read verified are the page's whichever store sent them, so they are indexed in L2.

Tensor parallelism: the groups every rank holds alike (`CacheGroup.replicated`: MLA latents)
are written by rank 0 only, as SGLang's HiCache backs up MLA from rank 0 alone, and written
through whatever the write policy (`Stores.shared_groups`); the other ranks' writes of them
are skipped (`replica_skipped_pages`) and they read rank 0's objects, which their keys name
(`page_keyers`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from hicache.cache.planner import FetchPlan, Planner
from hicache.cache.read_rate import ReadRate
from hicache.index import PageRecord, PrefixIndex
from hicache.memory import HostTier
from hicache.storage import GuardedStore

log = logging.getLogger("hicache.cache")
SETTLE_WAIT_S = 60.0  # at shutdown, for L3 reads that timed out to finish on their threads


class L3Io:
    def __init__(
        self,
        index: PrefixIndex,
        host_tier: HostTier,
        planner: Planner,
        current: Callable[[], GuardedStore | None],
        clock: Callable[[], float] = time.perf_counter,
        replica_groups: frozenset[str] = frozenset(),
    ):
        self.index = index
        self.host_tier = host_tier
        self.planner = planner
        self.current = current  # the store attached now (None: none)
        self.read_rate = ReadRate()
        self.reading_bytes = 0  # asked of L3 by the reads in flight
        self._clock = clock
        # groups another rank (0) writes to L3 for this one: never written from here
        self.replica_groups = replica_groups
        self.replica_skipped_pages = 0
        self._settling: set[asyncio.Future[None]] = set()  # fetches whose threads still run

    async def write(
        self, l3: GuardedStore | None, records: Mapping[str, Sequence[PageRecord]]
    ) -> tuple[int, int]:
        """Persist the records' L2 pages. Returns (written, skipped: no longer in L2, or in
        L3 already)."""
        items: list[tuple[bytes, list[memoryview]]] = []
        owners: dict[str, list[PageRecord]] = {}
        skipped = 0
        for group, group_records in records.items():
            if group in self.replica_groups:  # rank 0 writes it (it is the same there)
                skipped += len(group_records)
                self.replica_skipped_pages += len(group_records)
                continue
            pool = self.host_tier.pool(group)
            for record in group_records:
                page = record.l2_page
                current = self.index.record(group, record.key) is record
                if l3 is None or not current or page is None or record.in_l3:
                    skipped += 1
                else:  # the page's memory, uncopied: pinned so no eviction reuses it meanwhile
                    items.append((record.key, pool.page_views(page)))
                    owners.setdefault(group, []).append(record)
        if not items or l3 is None:
            return 0, skipped
        for group, owned in owners.items():
            self.index.pin(group, [r.key for r in owned])
        try:
            stored = iter(await l3.put(items))
        finally:
            for group, owned in owners.items():
                self.index.unpin(group, [r.key for r in owned])
        written = 0
        attached = self.current() is l3  # a store swapped out meanwhile: its acks mark nothing
        for group, owned in owners.items():  # the same order as `items`
            for record in owned:
                ok = next(stored)
                written += ok
                if ok and attached and self.index.record(group, record.key) is record:
                    self.index.mark_l3(group, record.key)
        return written, skipped

    async def read_into(self, l3: GuardedStore, plan: FetchPlan) -> int:
        """Read the plan's pages from L3 into its reserved host pages and commit it; returns
        the pages L2 gained."""
        keys: list[bytes] = []
        targets: list[list[memoryview]] = []
        spans: dict[str, tuple[int, int]] = {}
        for group, g in plan.groups.items():
            pool = self.host_tier.pool(group)
            start = len(keys)
            keys.extend(r.key for r in g.records)
            targets.extend(pool.page_views(p) for p in g.host_pages)
            spans[group] = (start, len(keys))
        page_bytes = {group: self.host_tier.pool(group).geometry.page_bytes for group in spans}
        asked = sum(page_bytes[group] * (b - a) for group, (a, b) in spans.items())
        ahead, started = self.reading_bytes, self._clock()
        self.reading_bytes += asked
        fetch = l3.fetch_into(keys, targets)
        try:
            result = await fetch
        except BaseException:  # cancelled: a read may still be writing the pages
            self._after_settled(fetch.settled, lambda: self.planner.abort_fetch(plan))
            raise
        finally:
            self.reading_bytes -= asked
        ok = {group: result.ok[a:b] for group, (a, b) in spans.items()}
        if self.current() is l3:
            answered = {group: result.answered_keys[a:b] for group, (a, b) in spans.items()}
            verified = sum(page_bytes[group] * sum(group_ok) for group, group_ok in ok.items())
            if verified:  # L3 read the reads ahead of this one, then this one, meanwhile
                self.read_rate.observe(ahead + verified, self._clock() - started)
        else:  # L3 was swapped meanwhile: what the old store lacks says nothing of the new one
            answered = {}
        gained, leftover = self.planner.commit_fetch(plan, ok, answered)
        if leftover:  # never freed while a read that timed out may still write them
            self._after_settled(result.settled, lambda: self.planner.free_pages(leftover))
        return gained

    def _after_settled(self, settled: asyncio.Future[None], release: Callable[[], None]) -> None:
        """Run `release` once no backend thread touches a fetch's pages (now, if so)."""
        if settled.done():
            release()
            return
        self._settling.add(settled)

        def done(_future: asyncio.Future[None]) -> None:
            self._settling.discard(settled)
            release()

        settled.add_done_callback(done)

    async def settle(self) -> None:
        """Until every L3 read that timed out has ended on its thread (at most
        `SETTLE_WAIT_S`: a backend that never returns leaks its pages, never reuses them)."""
        if not self._settling:
            return
        _, stuck = await asyncio.wait(self._settling, timeout=SETTLE_WAIT_S)
        if stuck:
            log.error(
                "%d L3 reads did not settle in %s s; their pages stay reserved",
                len(stuck),
                SETTLE_WAIT_S,
            )
