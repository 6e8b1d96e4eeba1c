"""`Stores`: the tiered cache's store path, L1 -> L2 (-> L3 behind) — what
`TieredCache.store` runs once it has checked the request and computed the prompt's keys.

    result = await stores.store(keys, wanted, fence, attachment)   # StoreResult

A store is rounds of plan / backup / commit. Each round persists first the write-back
victims its room costs (the persist queue gives them up), then plans the wanted pages the
index lacks and no other store holds (`Planner.plan_store`), backs them up on the scheduler
after `fence`, and commits them (offering them to L3 per the write policy; rank 0's
replicated groups at TP > 1 always, `shared_groups`) or aborts the plan (answered with the
prefix before its first page, `truncated_to_tokens`) — exactly once, and never while a copy
may still write its pages: a caller that stops waiting has the plan aborted when its backup
ends. Pages another store is backing up
meanwhile (another engine's, of the same prefix) are waited for until that store has ended
(the planner's `store_ended` hook wakes the waiters, `plan_ended` here; orphaned plans are
swept every `_SETTLE_POLL_S`; a lookup waiting for a store in flight waits the same way,
`until_settled`), and what it did not store the next round stores, for at most
`_STORE_ROUNDS` rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from hicache.cache.persist import PersistQueue
from hicache.cache.planner import Planner, StorePlan
from hicache.index import PageKey, PageRecord, PrefixIndex, WritePolicy
from hicache.scheduler import GroupPages, OpResult, Scheduler
from hicache.storage import GuardedStore
from hicache.transfer import Fence

_STORE_ROUNDS = 8  # a store waits for other stores of its pages at most this many times
_SETTLE_POLL_S = 0.05  # how often a store waiting for another one sweeps orphaned plans

Write = Callable[[Mapping[str, Sequence[PageRecord]]], Awaitable[tuple[int, int]]]


@dataclass(frozen=True, slots=True)
class StoreResult:
    pages_stored: int  # new L2 pages across groups
    pages_queued: int  # offered to L3 by the write policy (written behind the ack)
    pages_evicted: int
    bytes_backed_up: int = 0  # L1 -> L2
    backup_seconds: float = 0.0
    # L2 holds only this prefix of the prompt's pages (L2 full, or the backup failed); None:
    # every page asked for is stored
    truncated_to_tokens: int | None = None


class Stores:
    def __init__(
        self,
        index: PrefixIndex,
        planner: Planner,
        persist: PersistQueue,
        scheduler: Scheduler,
        write: Write,
        write_policy: Callable[[], WritePolicy],
        l3: Callable[[], GuardedStore | None],
        replica_groups: frozenset[str],
        shared_groups: frozenset[str] = frozenset(),
    ):
        self.index = index
        self.planner = planner
        self.persist = persist
        self.scheduler = scheduler
        self._write = write  # L2 -> L3 now (`Flusher.write`): write-back victims
        self._write_policy = write_policy  # the cache's, now
        self._l3 = l3  # the store attached now (None: none)
        self.replica_groups = replica_groups  # rank 0 writes those to L3
        # rank 0's replicated groups at TP > 1: written through whatever the policy (every
        # other rank reads them from L3 only)
        self.shared_groups = shared_groups
        self._store_ended = asyncio.Event()

    async def store(
        self,
        keys: Mapping[str, Sequence[PageKey]],
        wanted: Mapping[str, Sequence[tuple[int, int]]],
        fence: Fence | None,
        attachment: int,
    ) -> StoreResult:
        """Rounds of `_store_round` until no page is left to another store in flight (at most
        `_STORE_ROUNDS`); the sum of what they did."""
        total = StoreResult(0, 0, 0)
        for _ in range(_STORE_ROUNDS):
            part, waits = await self._store_round(keys, wanted, fence, attachment)
            total = StoreResult(
                total.pages_stored + part.pages_stored,
                total.pages_queued + part.pages_queued,
                total.pages_evicted + part.pages_evicted,
                total.bytes_backed_up + part.bytes_backed_up,
                total.backup_seconds + part.backup_seconds,
                part.truncated_to_tokens,
            )
            if not waits:
                break
            # pages another store (another engine's, of this prompt's prefix) is backing up:
            # acknowledged once it has ended; what it did not store, the next round stores
            await self.until_settled(waits)
        return total

    async def _store_round(
        self,
        keys: Mapping[str, Sequence[PageKey]],
        wanted: Mapping[str, Sequence[tuple[int, int]]],
        fence: Fence | None,
        attachment: int,
    ) -> tuple[StoreResult, dict[str, frozenset[PageKey]]]:
        """One plan / backup / commit of the wanted pages the index lacks and no other
        store holds; returns what it did and the keys left to other stores in flight."""
        size = self.index.page_size_tokens
        evicted = 0
        own = {group: frozenset(group_keys) for group, group_keys in keys.items()}
        dirty = self.planner.write_back_victims(self.planner.store_needs(keys, wanted), own)
        if dirty:
            self.persist.withdraw(dirty)  # written here and now, not by the worker
            write = asyncio.ensure_future(self._write(dirty))
            try:
                await asyncio.shield(write)
            except BaseException:
                await asyncio.wait({write})  # its thread reads the pages: they wait for it
                raise
            finally:
                evicted += self.planner.evict_victims(dirty)
        plan = self.planner.plan_store(keys, wanted)
        evicted += plan.evicted
        truncated = None if plan.truncated_to_pages is None else plan.truncated_to_pages * size
        if not plan.groups:
            return StoreResult(0, 0, evicted, truncated_to_tokens=truncated), plan.waits
        result = await self._backup(plan, fence, attachment)
        if not result.ok:
            self.planner.abort_store(plan)
            # none of the plan landed: what L2 holds of the prompt ends at its first page (an
            # answer without a cut reads "every page stored", and engines publish it so)
            first = min(min(g.positions) for g in plan.groups.values())
            if plan.truncated_to_pages is not None:
                first = min(first, plan.truncated_to_pages)
            return StoreResult(0, 0, evicted, truncated_to_tokens=first * size), {}
        records = self.planner.commit_store(plan)
        policy = self._write_policy()
        to_l3 = {
            g: [r for r in rs if policy.on_store(r) or (g in self.shared_groups and not r.in_l3)]
            for g, rs in records.items()
            if g not in self.replica_groups  # rank 0 writes those
        }
        queued = self.persist.offer(to_l3) if self._l3() is not None else 0
        stored = sum(len(rs) for rs in records.values())
        done = StoreResult(stored, queued, evicted, result.bytes_moved, result.seconds, truncated)
        return done, plan.waits

    async def until_settled(self, waits: Mapping[str, frozenset[PageKey]]) -> None:
        """Until no key of `waits` is pending: the stores holding them committed or aborted.
        Each is bounded by its backup's deadline; a plan whose caller left is aborted at a
        sweep once its copy ended, so the wait sweeps too (at `_SETTLE_POLL_S` at most)."""
        while True:
            self.planner.sweep()
            if not self.planner.still_pending(waits):
                return
            ended = self._store_ended
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_SETTLE_POLL_S):
                    await ended.wait()

    def plan_ended(self) -> None:
        """The planner's hook: a store plan committed or aborted; wake the stores waiting."""
        self._store_ended.set()
        self._store_ended = asyncio.Event()

    async def _backup(self, plan: StorePlan, fence: Fence | None, attachment: int) -> OpResult:
        """The plan's copies, after `fence`; on the caller's cancellation the plan is aborted
        when the backup ends (its copies write the reserved pages until then)."""
        request = {
            g: GroupPages(tuple(s.device_pages), tuple(s.host_pages))
            for g, s in plan.groups.items()
        }
        try:
            handle = await self.scheduler.backup(request, fence=fence, attachment=attachment)
        except BaseException:
            # refused, or the caller left: if its walk started, it writes the pages until it
            # ends, so they are given back then
            self.planner.abort_store_later(plan)
            raise
        try:
            return await handle.done()
        except BaseException:
            handle.cancel()
            handle.add_done_callback(lambda _result: self.planner.abort_store(plan))
            raise
