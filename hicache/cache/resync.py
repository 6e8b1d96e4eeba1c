"""`Resync`: after an L3 outage, find what L3 lost and put back what L2 still holds.

A backend whose breaker opened and closed again may have come back empty: a Mooncake master or
a Redis without persistence restarted, a file L3 directory replaced. The index would go on
marking pages "in L3" that are not there: lookups promise them (each load then misses and
recomputes), and an L2 copy of such a page, clean in the index's eyes, is evicted without ever
being written again — L3 stays empty of the hot set until every prefix has been recomputed.

Lifecycle: `due()` is asked at the start of the cache's ops (an int compare against the
breaker's `outages`, which counts its open -> closed transitions); once an outage has ended
since the last resync, the cache spawns `run(store)` in its TaskGroup. The run asks L3
(`exists`, batched) about every page the index marks as in L3. A page L3 answers absent loses
its mark: an L3-only record goes (lookups stop promising it), and a page L2 still holds is
offered to the persist queue (policies that write at store or hit), or left dirty for its
eviction to write (write-back). A batch L3 does not answer stops the run; the check is still
due, and starts again once `retry_after_s` has passed (a flaky L3 is not asked at every op).
A store swapped in meanwhile (`attach_l3`) ends it too: the new store's marks start empty
anyway. A store may answer reads again before it takes writes: a restarted Mooncake master
holds no segment until its clients mount theirs again, and refuses every put as "no space"
meanwhile. So once the check is done, the run waits for the pages it offered to be written;
those still in L2 and not in L3 after their write are offered again after `retry_after_s`,
up to `REWRITE_ROUNDS` times (`rewrites`), and what is still unwritten then is counted
(`unwritten`) and left to the write policy (an eviction or a later store). One run at a
time (the rewrite rounds included: `TieredCache.drain` waits for them). Counted in `stats()`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from hicache.cache.persist import PersistQueue
from hicache.index import PageRecord, PrefixIndex
from hicache.index.policies import WritePolicy
from hicache.storage import GuardedStore

BATCH_PAGES = 512
RETRY_AFTER_S = 2.0
REWRITE_ROUNDS = 5  # offers of a page the first rewrite did not get into L3


@dataclass(frozen=True, slots=True)
class ResyncStats:
    runs: int  # outages whose end started a check
    checked: int  # pages asked about
    lost: int  # marked in L3, absent there: marks dropped
    requeued: int  # of those, L2 copies offered to the persist queue
    stopped: int  # runs L3 stopped answering (or a swap) cut short
    rewrites: int = 0  # pages offered again: their rewrite did not reach L3
    unwritten: int = 0  # pages still in L2 only after the last round


class Resync:
    def __init__(
        self,
        index: PrefixIndex,
        persist: PersistQueue,
        write_policy: WritePolicy,
        current: Callable[[], GuardedStore | None],
    ):
        self.index = index
        self.persist = persist
        self.write_policy = write_policy
        self.current = current
        self._seen: tuple[int, int] | None = None  # (id of the store, its outages) checked
        self.running = False
        self.retry_after_s = RETRY_AFTER_S
        self.clock = time.monotonic
        self._not_before = 0.0
        self._runs = self._checked = self._lost = self._requeued = self._stopped = 0
        self._rewrites = self._unwritten = 0

    def attached(self, store: GuardedStore | None) -> None:
        """A store is attached: its outages so far are not ours to check (the index starts
        empty of its pages)."""
        self._seen = None if store is None else (id(store), store.breaker.outages)

    def due(self) -> GuardedStore | None:
        """The store to check now: an outage of it ended since the last check."""
        store = self.current()
        if store is None or self.running or self.clock() < self._not_before:
            return None
        if self._seen == (id(store), store.breaker.outages):
            return None
        return store

    async def run(self, store: GuardedStore) -> None:
        checking = (id(store), store.breaker.outages)
        self.running = True
        self._runs += 1
        offered: dict[str, list[PageRecord]] = {}
        try:
            for group in list(self.index.rules):
                marked = self.index.l3_records(group)
                for start in range(0, len(marked), BATCH_PAGES):
                    batch = marked[start : start + BATCH_PAGES]
                    present, answered = await store.exists_answered([r.key for r in batch])
                    if self.current() is not store:
                        self._stopped += 1
                        return  # swapped: the new store's marks start empty
                    if not answered:
                        self._stopped += 1
                        self._not_before = self.clock() + self.retry_after_s
                        return  # still due: asked again after the pause
                    self._checked += len(batch)
                    gone = [r for r, here in zip(batch, present, strict=True) if not here]
                    offered.setdefault(group, []).extend(self._settle(group, gone))
            self._seen = checking
            await self._confirm(store, offered)
        finally:
            self.running = False

    async def _confirm(self, store: GuardedStore, offered: dict[str, list[PageRecord]]) -> None:
        """Until the pages offered are written; the ones a write left out of L3 (still in
        L2) are offered again after a pause, up to `REWRITE_ROUNDS` times."""
        pending = offered
        for round_ in range(REWRITE_ROUNDS + 1):
            while any(self.persist.waiting(g, r) for g, rs in pending.items() for r in rs):
                await self.persist.next_change()
            await self.persist.batch_end()  # the batch that took the last of them
            pending = self._unwritten_of(pending)
            if not pending or self.current() is not store:
                return
            if round_ == REWRITE_ROUNDS:
                break
            await asyncio.sleep(self.retry_after_s)
            pending = self._unwritten_of(pending)
            if self.current() is not store:
                return
            self._rewrites += self.persist.offer(pending)
        self._unwritten += sum(len(rs) for rs in pending.values())

    def _unwritten_of(self, pages: dict[str, list[PageRecord]]) -> dict[str, list[PageRecord]]:
        """The pages still in L2, not in L3, the index's record for their key."""
        left = {
            group: [
                r
                for r in records
                if self.index.record(group, r.key) is r and r.l2_page is not None and not r.in_l3
            ]
            for group, records in pages.items()
        }
        return {group: records for group, records in left.items() if records}

    def _settle(self, group: str, absent: list[PageRecord]) -> list[PageRecord]:
        """Drop the L3 marks of the pages L3 lost; returns the L2 copies offered again."""
        again = []
        for record in absent:
            if self.index.record(group, record.key) is not record or not record.in_l3:
                continue  # evicted, dropped or re-marked meanwhile
            self.index.drop_l3(group, record.key)
            self._lost += 1
            if record.l2_page is not None and not self.write_policy.on_evict(record):
                again.append(record)
        if again:
            self._requeued += self.persist.offer({group: again})
        return again

    def stats(self) -> ResyncStats:
        return ResyncStats(
            self._runs,
            self._checked,
            self._lost,
            self._requeued,
            self._stopped,
            self._rewrites,
            self._unwritten,
        )
