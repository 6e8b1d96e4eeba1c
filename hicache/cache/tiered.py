"""`TieredCache`: the cache an engine talks to — index, host tier (L2), storage (L3) and the
scheduler of one stage — as plan / execute / commit.

    async with cache.running():            # owns the scheduler, the persist worker, fetches
        hit = cache.lookup(tokens)          # no side effects: a probe is not a use
        await cache.store(tokens, device_pages, snapshots=...)  # acked once L2 holds it
        handle, hit = await cache.load(tokens, device_pages)    # L3 -> L2 per the prefetch
                                                                # policy, then layer by layer
Every op is a pure plan (`planner.py`: reserve host pages, pin, choose victims, mark keys
pending — no awaits), an execution (the scheduler's copies, L3 I/O — the only awaits), and a
commit or an abort (the planner again), exactly once on every path: success, error, or the
caller's cancellation at any await. A backup or load the caller stops waiting for is
released when its op ends, never before (its copies still touch the pages); a page an L3
read may still write is freed only once that read has settled. The façade checks a request,
keeps the running state and hands the execution to the op paths it composes, each given the
parts it uses: `stores.py` (store), `loads.py` (load, prefetch), `flush.py` (L2 -> L3 writes,
the flush).

Tasks: `running()` opens a TaskGroup that owns the persist worker (`persist.py`: write-through
is acknowledged at L2 and written to L3 behind it, through a bounded queue whose drops are
counted) and every background L3 -> L2 fetch; nothing is fire-and-forget. L3 errors never
reach the caller: a page that cannot be fetched shortens the hit (`hit.failed`).

L3 can be attached, detached or replaced at any time, ops in flight (`attach_l3`, the admin
API): an op that finds L3 gone misses the L3 part and serves what L2 holds; one still talking
to the store that left finishes there, and records nothing it learnt (see `l3_io.py`). When an
outage of L3 ends (its breaker closes again), a background check finds the pages it lost and
persists again what L2 holds (`resync.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import replace
from typing import Any

from hicache.cache.discovery import Discovery
from hicache.cache.flush import Flushed, Flusher
from hicache.cache.l3_io import L3Io
from hicache.cache.loads import Loads
from hicache.cache.persist import PersistQueue
from hicache.cache.planner import Planner
from hicache.cache.requests import check_load_pages, store_positions
from hicache.cache.resync import Resync
from hicache.cache.settings import CacheSettings, effective, index_of, prefetch_of
from hicache.cache.shares import TenantPages
from hicache.cache.stores import StoreResult, Stores
from hicache.embedded import EmbeddedCache, check_pools_device, check_tp_rank
from hicache.errors import HicacheError
from hicache.index import (
    WRITE_POLICIES,
    AbsentKeys,
    Hit,
    PageKey,
    PrefetchPolicy,
    PrefixIndex,
    Served,
    WritePolicy,
)
from hicache.memory import DevicePool, HostPoolStats
from hicache.scheduler import DEFAULT_ATTACHMENT, OpHandle, SchedulerStats
from hicache.storage import GuardedStore
from hicache.transfer import CopyBackend, Fence, LayerListener

log = logging.getLogger("hicache.cache")


class CacheNotRunningError(HicacheError, RuntimeError):
    """An op was asked of a cache outside `async with cache.running()`."""


class TieredCache:
    def __init__(
        self,
        embedded: EmbeddedCache,
        index: PrefixIndex,
        store: GuardedStore | None,
        write_policy: WritePolicy,
        prefetch_policy: PrefetchPolicy,
        absent: AbsentKeys,
        persist_queue_pages: int,
        tp_rank: int,
    ):
        self.embedded = embedded
        self.tp_rank = tp_rank
        # groups every rank holds alike: rank 0 writes them to L3 (whatever the write policy:
        # the other ranks read them there only), the other ranks read them
        replicated = frozenset(
            g.name
            for g in embedded.layer_map.groups
            if g.replicated and embedded.layer_map.layout.tp_size > 1
        )
        replica_groups = replicated if tp_rank != 0 else frozenset()
        shared_groups = replicated if tp_rank == 0 else frozenset()
        self.index = index
        # another rank writes replica groups: an "absent" L3 said may be stale any moment
        self.discovery = Discovery(index, absent, lambda: self.l3, distrusted=replica_groups)
        self.settings: CacheSettings | None = None  # what `build` was given
        self.write_policy = write_policy
        self.prefetch_policy = prefetch_policy
        allocators = {
            g: p.allocator for g, p in embedded.host_tier.pools.items() if g in index.rules
        }
        self.planner = Planner(index, allocators, write_policy, replica_groups)
        self.persist = PersistQueue(persist_queue_pages)
        self.planner.owed = self.persist.waiting
        self.background_errors = 0
        self.l3: GuardedStore | None = None
        self.io = L3Io(
            index,
            embedded.host_tier,
            self.planner,
            lambda: self.l3,
            replica_groups=replica_groups,
        )
        self.resync = Resync(index, self.persist, write_policy, lambda: self.l3)
        self.attach_l3(store)
        self._tg: asyncio.TaskGroup | None = None
        self._fetches: set[asyncio.Task[Any]] = set()
        # the op paths, each given the parts it uses; they read L3 and the policies as the
        # cache holds them now (`attach_l3` swaps L3; the policies may be replaced)
        scheduler = embedded.scheduler
        self.flusher = Flusher(
            index, self.persist, self.io, lambda: self.l3, lambda: self._tg is not None
        )
        self.stores = Stores(
            index,
            self.planner,
            self.persist,
            scheduler,
            self.flusher.write,
            lambda: self.write_policy,
            lambda: self.l3,
            replica_groups,
            shared_groups,
        )
        self.planner.store_ended = self.stores.plan_ended
        self.loads = Loads(
            index,
            self.planner,
            self.persist,
            self.io,
            scheduler,
            embedded.host_tier,
            lambda: self.l3,
            lambda: self.prefetch_policy,
            self._spawn,
        )
        # groups the move policy leaves to the engine (full_attention_only): not cached
        self._recomputed = {g.name for g in embedded.layer_map.groups} - set(index.rules)

    def attach_l3(self, store: GuardedStore | None) -> None:
        """Use `store` as L3 from now on (None: none) — at start, or at any time ops are in
        flight (the admin API's attach and detach). Its backend registers the host pools,
        into which fetches scatter and from which puts read. Another store than the one
        attached resets what the cache knew of L3: the index's L3 marks and the remembered
        "absent" answers are dropped (the new store is asked again at lookup), pages queued
        for the old store are dropped and counted (`persist.stats().detached_pages`), the
        measured read rate starts over. Ops in flight finish on the store they started on
        and record nothing it says once it has left; an op that finds no L3 misses the L3
        part of its hit. Attaching the store that is attached changes nothing."""
        if store is self.l3:
            return
        if self.l3 is not None:
            self.persist.detach()
            self.planner.forget_l3()
            self.discovery.forget()
            self.io.read_rate.reset()
        self.l3 = store
        self.resync.attached(store)
        if store is not None:
            for pool in self.embedded.host_tier.pools.values():
                store.backend.register_memory(pool.buffer.numpy().data)

    @classmethod
    def build(
        cls,
        embedded: EmbeddedCache,
        settings: CacheSettings,
        *,
        store: GuardedStore | None,
        model: str,
        tp_rank: int | None = None,
    ) -> TieredCache:
        """A cache over `embedded` with `settings` (the `cache` section's, read by
        `hicache.assembly`); the `prefetch_timeout_*` / `prefetch_auto_*` ones shape the
        `timeout` policy only. `model` is the weights' identity in every page key. `tp_rank`
        (default: the embedded stack's) is the rank this cache serves, one of its layout's
        tp_size."""
        if tp_rank is None:
            tp_rank = embedded.tp_rank
        check_tp_rank(tp_rank, embedded.layer_map.layout.tp_size, "TieredCache.build")
        index = index_of(embedded, settings, model=model, tp_rank=tp_rank)
        prefetch = prefetch_of(settings)
        cache = cls(
            embedded,
            index,
            store,
            WRITE_POLICIES[settings.write_policy](),
            prefetch,
            AbsentKeys(settings.l3_absent_ttl_s),
            settings.persist_queue_pages,
            tp_rank,
        )
        cache.settings = settings
        return cache

    def effective_settings(self) -> dict[str, object]:
        """What this cache runs with, read back from its parts (`settings.effective`)."""
        return effective(self)

    # ---- lifecycle --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[TieredCache]:
        """Serve ops: the scheduler runs, the persist worker writes L3 behind acked stores.
        On exit every background fetch and queued persist is awaited first."""
        async with self.embedded.scheduler.running(), asyncio.TaskGroup() as tg:
            self._tg = tg
            worker = tg.create_task(self.persist.run(self.flusher.write), name="hicache-persist")
            try:
                yield self
            finally:
                await self.drain()
                worker.cancel()
                self._tg = None

    def _group(self) -> asyncio.TaskGroup:
        if self._tg is None:
            raise CacheNotRunningError(
                "the cache is not running; serve ops inside `async with cache.running():`"
            )
        return self._tg

    def _spawn(
        self, make: Callable[[], Coroutine[Any, Any, object]], name: str
    ) -> asyncio.Task[Any]:
        """A background task owned by the running cache; its errors are logged and counted,
        never raised into the TaskGroup (they would cancel every op)."""

        group = self._group()  # before the coroutine exists: none is left un-awaited

        async def guarded() -> object:
            try:
                return await make()
            except Exception:
                self.background_errors += 1
                log.exception("background %s failed", name)
                return None

        task = group.create_task(guarded(), name=f"hicache-{name}")
        self._fetches.add(task)
        task.add_done_callback(self._fetches.discard)
        return task

    async def drain(self) -> None:
        """Until no fetch is in flight and no persist is queued (shutdown; tests)."""
        while self._fetches:
            await asyncio.gather(*self._fetches, return_exceptions=True)
        await self.io.settle()  # L3 reads that timed out, their threads still writing
        if self._tg is not None:
            await self.persist.idle()
            await self.embedded.scheduler.idle()  # ops whose callers left end too
        self.planner.sweep()

    def _moved(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """A request's groups the cache keeps; the ones the move policy leaves to the engine
        are dropped (an unknown group stays, to be refused by name)."""
        return {g: value for g, value in given.items() if g not in self._recomputed}

    # ---- lookup -----------------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int]) -> Hit:
        """How much of the prompt each tier can serve, now; changes nothing."""
        self._resync_if_due()
        return self.index.lookup(token_ids)

    def _resync_if_due(self) -> None:
        """An L3 outage ended since the last check: find what L3 lost in the background
        (`resync.py`) — a restarted server may have come back empty."""
        store = self.resync.due() if self._tg is not None else None
        if store is not None:
            self._spawn(lambda: self.resync.run(store), "l3-resync")

    def needs_discovery(self, token_ids: Sequence[int], hit: Hit) -> bool:
        """Could L3 extend this hit with pages the index does not know (persisted before a
        restart, or by another process)? Only then is a lookup worth an L3 round trip."""
        return self.l3 is not None and self.discovery.needed(token_ids, hit)

    async def discover(self, token_ids: Sequence[int]) -> int:
        """Ask L3 which of the prompt's pages it holds that the index does not know of, and
        record them. Returns how many."""
        l3 = self.l3
        return 0 if l3 is None else await self.discovery.run(l3, token_ids)

    # by keys: an engine that computed the prompt's page keys once (`PageKeyer.from_root`
    # with the roots `key_roots` gives) sends them instead of its tokens: nothing is rehashed

    def key_roots(self) -> dict[str, bytes]:
        """Each cached group's keyer root: with the page size and `key_algorithm`, all an
        engine needs to compute the very keys this cache's index holds."""
        return {group: keyer.root for group, keyer in self.index.keyers.items()}

    def lookup_keys(
        self, keys: Mapping[str, Sequence[PageKey]], groups: Collection[str] | None = None
    ) -> Hit:
        """`lookup` of a prompt given by every cached group's keys of its full pages; the
        counts only (no `needed`). `groups`: the hit of those groups alone (None: all)."""
        self._resync_if_due()
        return self.index.lookup_keys(keys, rows=False, groups=groups)

    def served_keys(
        self, keys: Mapping[str, Sequence[PageKey]], groups: Collection[str] | None = None
    ) -> dict[str, Served]:
        """Per group (of `groups`), the prompt's pages it holds (`PrefixIndex.served`): an
        engine that moves each pool on its own applies its own hit rules to them."""
        self._resync_if_due()
        return self.index.served(keys, groups)

    def needs_discovery_keys(
        self, keys: Mapping[str, Sequence[PageKey]], hit: Hit, trust_absent: bool = True
    ) -> bool:
        return self.l3 is not None and self.discovery.needed_keys(keys, hit, trust_absent)

    async def discover_keys(
        self, keys: Mapping[str, Sequence[PageKey]], trust_absent: bool = True
    ) -> int:
        l3 = self.l3
        return 0 if l3 is None else await self.discovery.run_keys(l3, keys, trust_absent)

    # ---- store: L1 -> L2 (-> L3 behind) ------------------------------------------------------

    def store(
        self,
        token_ids: Sequence[int],
        device_pages: Mapping[str, Sequence[int | None]],
        *,
        snapshots: Mapping[str, Mapping[int, int]] | None = None,
        fence: Fence | None = None,
        attachment: int = DEFAULT_ATTACHMENT,
    ) -> Coroutine[Any, Any, StoreResult]:
        """Back up the prompt's pages the index lacks; acknowledged once L2 holds them (L3
        is written behind, per the write policy). Token groups list a device page per full
        page in token order, None where the engine no longer holds it (a sliding window's
        freed pages): those are never stored, so never served. State groups give their
        snapshots as `{num_tokens: device_slot}`: the state after exactly num_tokens tokens
        (a multiple of the page size), filed under that prefix. A prompt larger than L2
        stores its longest prefix that fits. Pages of the prompt another store is backing up
        meanwhile (another engine's, of the same prefix) are stored once, by that store: this
        one is acknowledged once it ended, and stores what it did not.
        `attachment`: whose device pools the pages are (the scheduler's; one per engine).

        Ordering (CUDA): the copies wait on `fence`, the point after the kernels that wrote
        the pages — `backend.producer_fence(stream)` made on the engine's thread, or
        `NO_FENCE` once the engine synchronised. Without one, it is taken here, when this is
        called — on the calling thread's current stream, before the coroutine is scheduled
        (`run_coroutine_threadsafe(cache.store(...), loop)` from the engine's thread takes
        it there, not on the event loop's) — so an engine that calls this on the thread and
        stream its model runs on needs nothing more; one that wrote the pages on another
        stream or thread must pass its fence."""
        if fence is None:
            fence = self.embedded.backend.producer_fence()  # the caller's thread and stream
        return self._store(token_ids, device_pages, snapshots, fence, attachment)

    async def _store(
        self,
        token_ids: Sequence[int],
        device_pages: Mapping[str, Sequence[int | None]],
        snapshots: Mapping[str, Mapping[int, int]] | None,
        fence: Fence | None,
        attachment: int,
    ) -> StoreResult:
        self._group()
        self._resync_if_due()
        size = self.index.page_size_tokens
        full_pages = len(token_ids) // size
        wanted = store_positions(
            self.index.rules,
            size,
            self._moved(device_pages),
            self._moved(snapshots or {}),
            full_pages,
        )
        return await self.stores.store(self.index.keys(token_ids), wanted, fence, attachment)

    # ---- L2 -> L3 ---------------------------------------------------------------------------

    async def flush(self) -> int:
        """Persist every L2 page L3 lacks (what write-back owes at shutdown); returns how many
        were written."""
        return (await self.flush_within(None)).written

    async def flush_within(self, timeout_s: float | None) -> Flushed:
        """`flush` within `timeout_s` (None: however long it takes; the shutdown drain gives
        what is left of `service.drain_timeout_s`). First the persist queue empties, then the
        pages still owed are written `persist.batch_pages` at a time. At the deadline the
        write in flight is cancelled (an L3 object is whole or absent: writes are atomic and
        read back verified), and so is the persist worker's batch in flight, and the backend
        is told to stop writing (`stop_writes`: a thread already writing finishes that one
        object, which may still land); the pages still queued are dropped (`persist.detach`:
        counted as detached); what L3 lacks at the deadline is counted in the result."""
        return await self.flusher.flush_within(timeout_s)

    # ---- load: (L3 ->) L2 -> L1 -------------------------------------------------------------

    def load(
        self,
        token_ids: Sequence[int],
        device_pages: Mapping[str, Sequence[int]],
        *,
        on_layer: LayerListener | None = None,
        skip_pages: int = 0,
        fence: Fence | None = None,
        attachment: int = DEFAULT_ATTACHMENT,
    ) -> Coroutine[Any, Any, tuple[OpHandle | None, Hit]]:
        """Load the usable prefix into the given device pages; returns the handle (None when
        nothing beyond `skip_pages` hits) and the hit actually loaded — shorter than
        `lookup`'s when L3 pages could not be fetched in time, with those pages' positions in
        `hit.failed`. `skip_pages`: the engine's own device cache holds the prompt's first
        pages; only later ones move. `attachment`: whose device pools the pages are.
        Ordering (CUDA): the copies run after `fence` — the engine's work that still uses
        or zeroes the pages — taken when this is called, on the caller's thread and current
        stream, when None (as a store's)."""
        if fence is None:
            fence = self.embedded.backend.producer_fence()  # the caller's thread and stream
        keys = self.index.keys(token_ids)  # hashed once: discovery and the load share them
        return self._load_keys(
            keys, device_pages, on_layer, skip_pages, fence, attachment, len(token_ids)
        )

    # ---- by the engine's own keys: an engine that keys pages itself (SGLang's page hashes,
    # namespaced) and has no tokens to send; the same ops, keyed as given

    def store_keys(
        self,
        keys: Mapping[str, Sequence[PageKey]],
        device_pages: Mapping[str, Sequence[int | None]],
        *,
        snapshots: Mapping[str, Mapping[int, int]] | None = None,
        fence: Fence | None = None,
        attachment: int = DEFAULT_ATTACHMENT,
    ) -> Coroutine[Any, Any, StoreResult]:
        """`store` of a prompt given by every cached group's keys of its full pages (one
        per page, the same count in each) instead of its tokens. State groups' snapshots as
        `store`'s, `{num_tokens: slot}`: the state after the first num_tokens / page_size
        keys, filed under the group's key of the last of them (an engine that stores a
        state alone names the prompt by its keys up to there, and its token groups' pages
        None). The default fence is taken when this is called, as `store`'s."""
        if fence is None:
            fence = self.embedded.backend.producer_fence()  # the caller's thread and stream
        return self._store_keys(keys, device_pages, snapshots, fence, attachment)

    async def _store_keys(
        self,
        keys: Mapping[str, Sequence[PageKey]],
        device_pages: Mapping[str, Sequence[int | None]],
        snapshots: Mapping[str, Mapping[int, int]] | None,
        fence: Fence | None,
        attachment: int,
    ) -> StoreResult:
        self._group()
        self._resync_if_due()
        size = self.index.page_size_tokens
        full_pages = min((len(k) for k in keys.values()), default=0)
        wanted = store_positions(
            self.index.rules,
            size,
            self._moved(device_pages),
            self._moved(snapshots or {}),
            full_pages,
        )
        return await self.stores.store(keys, wanted, fence, attachment)

    def load_keys(
        self,
        keys: Mapping[str, Sequence[PageKey]],
        device_pages: Mapping[str, Sequence[int]],
        *,
        on_layer: LayerListener | None = None,
        skip_pages: int = 0,
        fence: Fence | None = None,
        attachment: int = DEFAULT_ATTACHMENT,
        groups: Collection[str] | None = None,
        l3_wait_s: float | None = None,
    ) -> Coroutine[Any, Any, tuple[OpHandle | None, Hit]]:
        """`load` of a prompt given by every cached group's page keys (see `store_keys`);
        `groups`: the hit and the copies of those groups alone, device pages named for them
        only (None: every group); `l3_wait_s`: how long to wait for L3-only pages (None: the
        prefetch policy's wait); the default fence is taken when this is called, as
        `load`'s."""
        if fence is None:
            fence = self.embedded.backend.producer_fence()  # the caller's thread and stream
        pages = min((len(k) for k in keys.values()), default=0)
        return self._load_keys(
            keys,
            device_pages,
            on_layer,
            skip_pages,
            fence,
            attachment,
            pages * self.index.page_size_tokens,
            groups,
            l3_wait_s,
        )

    async def _load_keys(
        self,
        keys: Mapping[str, Sequence[PageKey]],
        device_pages: Mapping[str, Sequence[int]],
        on_layer: LayerListener | None,
        skip_pages: int,
        fence: Fence | None,
        attachment: int,
        num_tokens: int,
        groups: Collection[str] | None = None,
        l3_wait_s: float | None = None,
    ) -> tuple[OpHandle | None, Hit]:
        """`load` and `load_keys` past their fence: a prompt of `num_tokens` tokens given by
        every cached group's page keys (moving `groups` alone: None, all)."""
        self._group()
        self._resync_if_due()
        pages = min((len(k) for k in keys.values()), default=0)
        rules = self.index.rules
        if groups is not None:
            rules = {g: rule for g, rule in rules.items() if g in groups}
        check_load_pages(rules, self._moved(device_pages), pages)
        await self.discover_keys({g: k for g, k in keys.items() if g in rules})
        return await self.loads.load(
            keys,
            device_pages,
            on_layer=on_layer,
            skip_pages=skip_pages,
            fence=fence,
            attachment=attachment,
            num_tokens=num_tokens,
            groups=groups,
            l3_wait_s=l3_wait_s,
        )

    async def prefetch(self, token_ids: Sequence[int]) -> int:
        """Bring the prompt's L3-only pages into L2 ahead of its load (the engine's hint when a
        request is queued); returns how many pages L2 gained."""
        self._group()
        self._resync_if_due()
        await self.discover(token_ids)
        return await self.loads.prefetch(token_ids)

    # ---- engines' pools and the numbers a service reports (no one reaches past the façade) ---

    @property
    def backend(self) -> CopyBackend:
        """The copy backend this cache's scheduler copies on."""
        return self.embedded.backend

    def attach_device_pools(
        self, device_pools: Mapping[str, DevicePool], *, attachment: int
    ) -> None:
        """Serve an engine's pools as the scheduler's attachment `attachment` beside the
        others; refused (ConfigError) on another device than this cache copies on."""
        check_pools_device(device_pools, self.embedded.backend)
        self.embedded.scheduler.attach_device_pools(device_pools, attachment=attachment)

    def drop_default_pools(self) -> None:
        """Forget the pools the stack was built on (the scheduler's default attachment): a
        sidecar namespace serves each engine's pools as its own attachment instead."""
        self.embedded.scheduler.detach_device_pools()
        self.embedded.device_pools = {}

    async def end_attachment(self, attachment: int) -> int:
        """Cancel and await `attachment`'s queued and running ops, then drop its pools;
        returns how many were cancelled."""
        return await self.embedded.scheduler.end_attachment(attachment)

    @property
    def attachments(self) -> int:
        """Device-pool sets the scheduler holds (one per attached engine)."""
        return len(self.embedded.scheduler.attachments)

    def scheduler_stats(self) -> SchedulerStats:
        return self.embedded.scheduler.stats()

    def host_pool_stats(self, group: str) -> HostPoolStats:
        """`group`'s L2 pool: its pages, their size, how many are free and pinned. On an L2
        shared by tenants (`cache.shares`), free means not this tenant's."""
        stats = self.embedded.host_tier.pool(group).stats()
        allocator = self.planner.allocators.get(group)
        if isinstance(allocator, TenantPages):
            return replace(stats, free_pages=stats.num_pages - allocator.held_pages)
        return stats

    # ---- admin ------------------------------------------------------------------------------

    def clear_l2(self) -> int:
        """Drop every L2 page nothing holds (the admin API); L3 copies stay findable."""
        return self.planner.evict_all()

    async def clear_l3(self) -> int:
        """Delete every L3 page the index knows of (the admin API); returns how many."""
        l3 = self.l3
        if l3 is None:
            return 0
        known = [
            (group, record.key)
            for group in self.index.rules
            for record in list(self.index.l3_records(group))
        ]
        await l3.delete([key for _, key in known])
        if self.l3 is not l3:
            return len(known)  # swapped meanwhile: the marks went with the old store
        for group, key in known:
            if self.index.record(group, key) is not None:
                self.index.drop_l3(group, key)
        return len(known)
