"""`Loads`: the tiered cache's load path, (L3 ->) L2 -> L1, and its prefetch — what
`TieredCache.load` / `prefetch` run once the request is checked and L3 was asked about pages
the index did not know.

    handle, hit = await loads.load(keys, device_pages, ...)   # the prompt's page keys
    gained = await loads.prefetch(token_ids)                        # L3 -> L2 only

A load looks the prompt up; when L3 holds part of the hit, a background fetch (owned by the
running cache: `spawn`) brings it into L2, awaited only as long as the prefetch policy's
wait (sized by the L3 bytes asked for behind the reads already in flight, at L3's measured
read rate); pages it did not bring in time shorten the hit (`hit.failed`) while it goes on
behind. Then the load plans and pins its hit (`Planner.plan_load`, after every await),
offers pages hit often enough to L3 (selective write-through), and hands the copies to the
scheduler; the pins are released when the load ends, or at once when it moves nothing or
the scheduler refuses it. A fetch plans its pages, waits for a persist batch that holds the
room it lacks, and reads them into reserved host pages (`L3Io.read_into`); it reads nothing
once L3 was detached or replaced meanwhile.

A fetch goes in rounds. A page that does not arrive because L3 answered that it is damaged
or gone (`commit_fetch` drops its L3 mark) breaks the hit there; the prompt is looked up
again, and the longest prefix the tiers still serve may need pages the longer hit did not
(a sliding window's pages before the break, a state group's snapshot stored at the shorter
length), which the next round fetches. The load then serves that prefix from L2, never 0
tokens for a break in the middle. Each round's hit is strictly shorter than the one before;
a round that shortens nothing (L3 did not answer, L2 has no room) is the last. Pages a
round read beyond the break stay in L2 as cached pages (unpinned, evictable); every
reservation of a round is committed or freed by `commit_fetch` as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from typing import Any

from hicache.cache.l3_io import L3Io
from hicache.cache.persist import PersistQueue
from hicache.cache.planner import Planner
from hicache.index import Hit, PageKey, PrefetchPolicy, PrefixIndex
from hicache.memory import HostTier
from hicache.scheduler import GroupPages, OpHandle, Scheduler
from hicache.storage import GuardedStore
from hicache.transfer import Fence, LayerListener

# a background task owned by the running cache (`TieredCache._spawn`), given how to start it
Spawn = Callable[[Callable[[], Coroutine[Any, Any, object]], str], "asyncio.Task[Any]"]


class Loads:
    def __init__(
        self,
        index: PrefixIndex,
        planner: Planner,
        persist: PersistQueue,
        io: L3Io,
        scheduler: Scheduler,
        host_tier: HostTier,
        l3: Callable[[], GuardedStore | None],
        prefetch_policy: Callable[[], PrefetchPolicy],
        spawn: Spawn,
    ):
        self.index = index
        self.planner = planner
        self.persist = persist
        self.io = io
        self.scheduler = scheduler
        self.host_tier = host_tier
        self._l3 = l3  # the store attached now (None: none)
        self._prefetch_policy = prefetch_policy  # the cache's, now
        self._spawn = spawn

    async def load(
        self,
        keys: Mapping[str, Sequence[PageKey]],
        device_pages: Mapping[str, Sequence[int]],
        *,
        on_layer: LayerListener | None,
        skip_pages: int,
        fence: Fence | None,
        attachment: int,
        num_tokens: int,
        groups: Collection[str] | None = None,
        l3_wait_s: float | None = None,
    ) -> tuple[OpHandle | None, Hit]:
        """`TieredCache.load` / `load_keys` past their checks, fence and discovery: the prompt
        of `num_tokens` tokens given by every cached group's page keys; the hit and the
        copies of `groups` alone (None: every group). `l3_wait_s`: how long to wait for the
        L3-only pages instead of the prefetch policy's wait (None: the policy's)."""
        size = self.index.page_size_tokens
        hit = self.index.lookup_keys(keys, skip_pages=skip_pages, groups=groups)
        failed: dict[str, tuple[int, ...]] = {}
        if hit.pages_total > hit.pages_l2 and self._l3() is not None:
            await self._prefetch(keys, skip_pages, hit, num_tokens, groups, l3_wait_s)
            failed = {
                group: lost
                for group, rows in hit.needed.items()
                if (lost := tuple(i for i, r in rows if r.l2_page is None))
            }
        plan = self.planner.plan_load(keys, skip_pages, groups)
        hot = {g: rs for g, rs in plan.hot.items() if g not in self.io.replica_groups}
        if hot and self._l3() is not None:
            self.persist.offer(hot)  # selective write-through: hit often enough (rank 0's)
        pages = plan.hit.pages_l2
        request = {}
        for group, rows in plan.hit.needed.items():
            if not rows:  # the engine holds all it needs (skip_pages), or a fresh chunk
                continue
            token_group = self.index.rules[group].kind.is_token_cache
            dev = device_pages[group]
            request[group] = GroupPages(
                tuple(dev[i] if token_group else dev[0] for i, _ in rows),
                tuple(r.l2_page for _, r in rows if r.l2_page is not None),
                num_tokens=pages * size if token_group else None,
                first_page=rows[0][0] if token_group else 0,
            )
        if pages <= skip_pages or not request:
            self.planner.release_load(plan)
            return None, Hit(size, 0, 0, {}, failed)
        try:
            handle = await self.scheduler.load(
                request, on_layer=on_layer, fence=fence, attachment=attachment
            )
        except BaseException:
            self.planner.release_load(plan)  # the copies' own pins keep the pages meanwhile
            raise
        handle.add_done_callback(lambda _result: self.planner.release_load(plan))
        return handle, Hit(size, pages, pages, plan.hit.needed, failed)

    async def prefetch(self, token_ids: Sequence[int]) -> int:
        """`TieredCache.prefetch` past its checks and the discovery."""
        keys = self.index.keys(token_ids)
        hit = self.index.lookup_keys(keys)
        if hit.pages_total == hit.pages_l2 or self._l3() is None:
            return 0
        gained = await self._spawn(lambda: self._fetch(keys, 0, hit), "prefetch")
        return int(gained or 0)

    async def _prefetch(
        self,
        keys: Mapping[str, Sequence[PageKey]],
        skip_pages: int,
        hit: Hit,
        tokens: int,
        groups: Collection[str] | None = None,
        l3_wait_s: float | None = None,
    ) -> None:
        """Bring the hit's L3-only pages into L2 within the prefetch policy's wait (or
        `l3_wait_s`, the caller's); the fetch goes on in the background past it (owned by
        the running cache), so the next request for the prefix finds it in L2."""
        l3_bytes = sum(
            self.host_tier.pool(group).geometry.page_bytes
            * sum(1 for _, r in rows if r.l2_page is None)
            for group, rows in hit.needed.items()
        )
        # the reads in flight go first (L3 serves them meanwhile), then this one
        queued = self.io.reading_bytes + l3_bytes
        wait = (
            self._prefetch_policy().wait_s(tokens, queued, self.io.read_rate.bytes_per_s())
            if l3_wait_s is None
            else l3_wait_s
        )
        task = self._spawn(lambda: self._fetch(keys, skip_pages, hit, groups), "fetch")
        if wait != 0.0:
            await asyncio.wait({task}, timeout=wait)

    async def _fetch(
        self,
        keys: Mapping[str, Sequence[PageKey]],
        skip_pages: int,
        hit: Hit,
        groups: Collection[str] | None = None,
    ) -> int:
        """The hit's L3-only pages into L2, in rounds. Where some page did not arrive —
        damaged or gone from L3, which the index learns from L3's answer — the hit it broke
        is looked up again: the longest prefix the tiers still serve, whose needs may
        differ (a window's pages before the break, a state group's snapshot at the shorter
        length, which the longer hit never asked for). Its pages L2 lacks are the next
        round. Each round's hit is strictly shorter than the last, so the rounds end; a
        round that shortens nothing (L3 did not answer, L2 has no room) is the last."""
        gained = 0
        while True:
            gained += await self._fetch_round(hit)
            if all(r.l2_page is not None for rows in hit.needed.values() for _, r in rows):
                return gained
            if self._l3() is None:
                return gained
            shorter = self.index.lookup_keys(keys, skip_pages=skip_pages, groups=groups)
            if shorter.pages_total >= hit.pages_total or shorter.pages_total == shorter.pages_l2:
                return gained
            hit = shorter

    async def _fetch_round(self, hit: Hit) -> int:
        """Plan, read, commit: the hit's L3-only pages into reserved host pages."""
        l3 = self._l3()
        if l3 is None:
            return 0
        plan = self.planner.plan_fetch(hit)
        if self.persist.writing and self.planner.fetch_short(hit):
            # the room is held by pages L3 is reading for a write behind an acked store: it
            # frees up when that batch ends (bounded by L3's timeouts)
            try:
                await self.persist.batch_end()
            except BaseException:
                self.planner.abort_fetch(plan)
                raise
            if self._l3() is not l3:  # detached or replaced meanwhile: nothing to read from
                self.planner.abort_fetch(plan)
                return 0
            self.planner.plan_fetch(hit, into=plan)
        if not plan.groups:
            self.planner.abort_fetch(plan)
            return 0
        return await self.io.read_into(l3, plan)
