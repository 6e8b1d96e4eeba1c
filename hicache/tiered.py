"""`TieredCache`: the cache an engine talks to — index, host tier (L2), storage (L3) and the
scheduler of one stage, wired together.

Lifecycle of a prefix:
    hit = cache.lookup(tokens)                              # usable tokens per tier, hybrid-aware
    await cache.store(tokens, device_pages)                 # backup new pages to L2, index them,
                                                            # persist per the write policy
    handle, hit = await cache.load(tokens, device_pages)    # discover L3 pages the index lacks,
                                                            # prefetch L3 -> L2 per the prefetch
                                                            # policy, then load L2 -> L1 layer by
                                                            # layer; a shorter hit if L3 fails
Pages are evicted from L2 when the host pool is full (write-back persists them first); an
evicted page that L3 holds stays findable. L3 errors never reach the caller: a page that
cannot be fetched shortens the hit. `device_pages[group]` lists the engine's device pages of
the prompt in token order (one snapshot slot for a state group).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hicache.discovery import Discovery
from hicache.embedded import EmbeddedCache
from hicache.index import (
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    AbsentKeys,
    GroupRule,
    Hit,
    Namespace,
    PageKeyer,
    PageRecord,
    PrefetchPolicy,
    PrefixIndex,
    WritePolicy,
)
from hicache.scheduler import GroupPages, OpHandle, OpRequestError
from hicache.storage import GuardedStore
from hicache.transfer import LayerListener


@dataclass(frozen=True, slots=True)
class StoreResult:
    pages_stored: int  # new L2 pages across groups
    pages_persisted: int  # pages written to L3 by the write policy
    pages_evicted: int
    bytes_backed_up: int = 0  # L1 -> L2
    backup_seconds: float = 0.0


class TieredCache:
    def __init__(
        self,
        embedded: EmbeddedCache,
        index: PrefixIndex,
        store: GuardedStore | None,
        write_policy: WritePolicy,
        prefetch_policy: PrefetchPolicy,
        absent: AbsentKeys | None = None,
    ):
        self.embedded = embedded
        self.index = index
        self.discovery = Discovery(index, absent if absent is not None else AbsentKeys(2.0))
        self.l3: GuardedStore | None = None
        self.attach_l3(store)
        self.write_policy = write_policy
        self.prefetch_policy = prefetch_policy
        self._background: set[asyncio.Task[None]] = set()  # best-effort prefetches

    def attach_l3(self, store: GuardedStore | None) -> None:
        """Use `store` as L3 (None: none); its backend registers the host pools, into which
        fetches scatter and from which puts read."""
        self.l3 = store
        if store is not None:
            for pool in self.embedded.host_tier.pools.values():
                store.backend.register_memory(pool.buffer.numpy().data)

    @classmethod
    def build(
        cls,
        embedded: EmbeddedCache,
        *,
        store: GuardedStore | None = None,
        model: str = "",
        write_policy: str = "write_through",
        prefetch_policy: str = "best_effort",
        eviction: str = "lru",
        tenant_salt: str = "",
        tp_rank: int = 0,
        key_algorithm: str = "xxh3_128",
        l3_index_max_pages: int = 262_144,
        l3_absent_ttl_s: float = 2.0,
    ) -> TieredCache:
        geometries = embedded.geometries
        page = next(iter(geometries.values())).page_size_tokens
        keyers, rules, capacity = {}, {}, {}
        for name, geom in geometries.items():
            namespace = Namespace(
                model=model or embedded.layer_map.model_type,
                model_type=embedded.layer_map.model_type,
                dtype=geom.dtype_signature,
                kv_layout=repr(geom.group.spec),
                page_size_tokens=page,
                group=name,
                tp_rank=tp_rank,
                pp_rank=embedded.layer_map.start_layer,
                tenant_salt=tenant_salt,
            )
            keyers[name] = PageKeyer(namespace, key_algorithm)
            rules[name] = GroupRule.of(geom.group)
            capacity[name] = embedded.host_tier.pool(name).num_pages
        index = PrefixIndex(keyers, rules, capacity, page, eviction, l3_index_max_pages)
        return cls(
            embedded,
            index,
            store,
            WRITE_POLICIES[write_policy](),
            PREFETCH_POLICIES[prefetch_policy](),
            AbsentKeys(l3_absent_ttl_s),
        )

    # ---- lookup ---------------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int]) -> Hit:
        return self.index.lookup(token_ids)

    def needs_discovery(self, token_ids: Sequence[int], hit: Hit) -> bool:
        """Could L3 extend this hit with pages the index does not know (persisted before a
        restart, or by another process)? Only then is a lookup worth an L3 round trip."""
        return self.l3 is not None and self.discovery.needed(token_ids, hit)

    async def discover(self, token_ids: Sequence[int]) -> int:
        """Ask L3 which of the prompt's pages it holds that the index does not know of, and
        record them. Returns how many."""
        return 0 if self.l3 is None else await self.discovery.run(self.l3, token_ids)

    # ---- store: L1 -> L2 (-> L3) -------------------------------------------------------------

    async def store(
        self,
        token_ids: Sequence[int],
        device_pages: Mapping[str, Sequence[int | None]],
        *,
        snapshots: Mapping[str, Mapping[int, int]] | None = None,
    ) -> StoreResult:
        """Back up the prompt's pages the index lacks. Token groups list a device page per
        full page in token order, None where the engine no longer holds it (a sliding
        window's freed pages): those are never stored, so never served. State groups give
        their snapshots as `{num_tokens: device_slot}`: the state after exactly num_tokens
        tokens (a multiple of the page size, at most the prompt's full pages), filed under
        that prefix; one per boundary the engine kept, so shorter prefixes hit too."""
        keys = self.index.keys(token_ids)
        full_pages = len(token_ids) // self.index.page_size_tokens
        wanted_pages = self._store_positions(device_pages, snapshots or {}, full_pages)
        request: dict[str, GroupPages] = {}
        new_keys: dict[str, list[bytes]] = {}
        evicted = 0
        for group, wanted in wanted_pages.items():
            group_keys = keys[group]
            # a page the index knows (L2, or L3 only) is not backed up again: L3's copy is as
            # good, and the engine may not hold it any more
            fresh = [(i, d) for i, d in wanted if self.index.record(group, group_keys[i]) is None]
            if not fresh:
                continue
            evicted += await self._make_room(group, len(fresh))
            request[group] = GroupPages(tuple(d for _, d in fresh))
            new_keys[group] = [group_keys[i] for i, _ in fresh]
        if not request:
            return StoreResult(0, 0, evicted)
        result = await (await self.embedded.scheduler.backup(request)).done()
        if not result.ok:
            return StoreResult(0, 0, evicted)
        to_persist: dict[str, list[PageRecord]] = {}
        stored = 0
        for group, outcome in result.groups.items():
            for key, host_page in zip(new_keys[group], outcome.host_pages, strict=True):
                record = self.index.insert_l2(group, key, host_page)
                stored += 1
                if self.write_policy.on_store(record):
                    to_persist.setdefault(group, []).append(record)
        persisted = await self._persist(to_persist)
        return StoreResult(stored, persisted, evicted, result.bytes_moved, result.seconds)

    def _store_positions(
        self,
        device_pages: Mapping[str, Sequence[int | None]],
        snapshots: Mapping[str, Mapping[int, int]],
        full_pages: int,
    ) -> dict[str, list[tuple[int, int]]]:
        """(page position, device page) per group that a store may back up, checked before
        anything is pinned or moved. A state group's snapshot for n tokens is its page
        n / page_size - 1 (keyed by the prompt's key of that page)."""
        size = self.index.page_size_tokens
        groups = sorted(self.index.rules)
        for group in (*device_pages, *snapshots):
            if group not in self.index.rules:
                raise OpRequestError(
                    f"store names group {group!r}, which is not in the layout; groups: {groups}"
                )
        out: dict[str, list[tuple[int, int]]] = {}
        for group, rule in self.index.rules.items():
            if rule.kind.is_token_cache:
                if group in snapshots:
                    raise OpRequestError(
                        f"snapshots.{group}: {group!r} is a {rule.kind.description} group; "
                        "its pages go in device_pages, snapshots are for state groups"
                    )
                given = device_pages.get(group)
                if given is None:
                    token_groups = [g for g in groups if self.index.rules[g].kind.is_token_cache]
                    raise OpRequestError(
                        f"device_pages has no group {group!r}; every token group of the layout "
                        f"({', '.join(token_groups)}) lists its pages (None for a page the "
                        "engine no longer holds)"
                    )
                if len(given) < full_pages:
                    raise OpRequestError(
                        f"device_pages.{group}: {len(given)} pages given; the prompt's "
                        f"{full_pages} full pages need {full_pages} entries (None for a page "
                        "the engine no longer holds)"
                    )
                out[group] = [(i, d) for i, d in enumerate(given[:full_pages]) if d is not None]
                continue
            if group in device_pages:
                raise OpRequestError(
                    f"device_pages.{group}: {group!r} is a {rule.kind.description} state group; "
                    "a store gives its snapshots as snapshots={group: {num_tokens: slot}}, "
                    "saying how many tokens each snapshot covers"
                )
            wanted = []
            for tokens, slot in sorted(snapshots.get(group, {}).items()):
                if tokens % size or not 0 < tokens <= full_pages * size:
                    raise OpRequestError(
                        f"snapshots.{group}: a snapshot after {tokens} tokens cannot be keyed; "
                        f"allowed: a multiple of the page size ({size}) in {size}.."
                        f"{full_pages * size} (the prompt's full pages)"
                    )
                wanted.append((tokens // size - 1, slot))
            out[group] = wanted
        return out

    def _check_device_pages(self, device_pages: Mapping[str, Sequence[int]], pages: int) -> None:
        """A load's device pages: every group lists a page per full page of the prompt (state
        groups: the one slot the snapshot lands in), before anything is pinned or moved."""
        for group, rule in self.index.rules.items():
            given = device_pages.get(group)
            if given is None:
                raise OpRequestError(
                    f"device_pages has no group {group!r}; the layout's groups are "
                    f"{sorted(self.index.rules)}"
                )
            need = pages if rule.kind.is_token_cache else min(pages, 1)
            if len(given) < need:
                raise OpRequestError(
                    f"device_pages.{group}: {len(given)} pages given; the prompt's {pages} full "
                    f"pages need {need}" + ("" if rule.kind.is_token_cache else " snapshot page")
                )

    async def _make_room(self, group: str, count: int) -> int:
        pool = self.embedded.host_tier.pool(group)
        short = count - pool.allocator.stats().free_pages
        if short <= 0:
            return 0
        victims = self.index.l2_victims(group, short)
        await self._persist({group: [v for v in victims if self.write_policy.on_evict(v)]})
        evicted = 0
        for victim in victims:
            # a load may have pinned it, or another eviction dropped it, while we persisted
            if victim.pins == 0 and victim.l2_page is not None:
                pool.allocator.free([self.index.drop_l2(group, victim.key)])
                evicted += 1
        return evicted

    async def _persist(self, records: Mapping[str, Sequence[PageRecord]]) -> int:
        if self.l3 is None:
            return 0
        items: list[tuple[bytes, list[memoryview]]] = []
        owners: list[tuple[str, PageRecord]] = []
        for group, group_records in records.items():
            pool = self.embedded.host_tier.pool(group)
            for record in group_records:
                if record.l2_page is not None and not record.in_l3:
                    # the page's chunks, uncopied: pinned below so no eviction reuses the page
                    # while L3 reads it
                    chunks = [c.numpy().data for c in pool.page_chunks(record.l2_page)]
                    items.append((record.key, chunks))
                    owners.append((group, record))
        if not items:
            return 0
        for group, record in owners:
            self.index.pin(group, [record.key])
        try:
            stored = await self.l3.put(items)
        finally:
            for group, record in owners:
                self.index.unpin(group, [record.key])
        for (group, record), ok in zip(owners, stored, strict=True):
            if ok:
                self.index.mark_l3(group, record.key)
        return sum(stored)

    # ---- load: (L3 ->) L2 -> L1 --------------------------------------------------------------

    async def load(
        self,
        token_ids: Sequence[int],
        device_pages: Mapping[str, Sequence[int]],
        *,
        on_layer: LayerListener | None = None,
        skip_pages: int = 0,
    ) -> tuple[OpHandle | None, Hit]:
        """Load the usable prefix into the given device pages; returns the handle (None when
        nothing beyond `skip_pages` hits) and the hit actually loaded — shorter than
        `lookup`'s when L3 pages could not be fetched in time, with those pages' positions in
        `hit.failed`. `skip_pages`: the engine's own device cache holds the prompt's first
        pages; only later ones move."""
        self._check_device_pages(device_pages, len(token_ids) // self.index.page_size_tokens)
        await self.discover(token_ids)
        hit = self.index.lookup(token_ids, skip_pages=skip_pages)
        await self._persist_hot(hit)
        failed: dict[str, tuple[int, ...]] = {}
        if hit.pages_total > hit.pages_l2:
            await self._prefetch(hit, len(token_ids))
            failed = {
                group: lost
                for group, rows in hit.needed.items()
                if (lost := tuple(i for i, r in rows if r.l2_page is None))
            }
            hit = self.index.lookup(token_ids, touch=False, skip_pages=skip_pages)
        pages, size = hit.pages_l2, hit.page_size_tokens
        if pages <= skip_pages:
            return None, Hit(size, 0, 0, {}, failed)
        keys = self.index.keys(token_ids)
        needed: dict[str, tuple[tuple[int, PageRecord], ...]] = {}
        for group, group_keys in keys.items():
            rows: list[tuple[int, PageRecord]] = []
            for i in self.index.rules[group].needed(pages, size):
                if i < skip_pages:
                    continue
                record = self.index.record(group, group_keys[i])
                assert record is not None
                assert record.l2_page is not None
                rows.append((i, record))
            needed[group] = tuple(rows)
        request = {}
        for group, group_rows in needed.items():
            if not group_rows:  # the engine holds all it needs (skip_pages), or a fresh chunk
                continue
            token_group = self.index.rules[group].kind.is_token_cache
            dev = device_pages[group]
            request[group] = GroupPages(
                tuple(dev[i] if token_group else dev[0] for i, _ in group_rows),
                tuple(r.l2_page for _, r in group_rows if r.l2_page is not None),
                num_tokens=pages * size if token_group else None,
                first_page=group_rows[0][0] if token_group else 0,
            )
        if not request:  # nothing to move (a chunked-only model at a chunk boundary)
            return None, Hit(size, 0, 0, {}, failed)
        pinned = {g: [r.key for _, r in rows] for g, rows in needed.items()}
        for group, group_keys in pinned.items():
            self.index.pin(group, group_keys)
        try:
            handle = await self.embedded.scheduler.load(request, on_layer=on_layer)
        except BaseException:
            self._unpin(pinned)
            raise
        handle.add_done_callback(lambda _result: self._unpin(pinned))
        return handle, Hit(size, pages, pages, needed, failed)

    async def _persist_hot(self, hit: Hit) -> None:
        """Selective write-through: persist pages whose hits reached the policy's bar."""
        hot = {
            group: [r for _, r in rows if r.l2_page is not None and self.write_policy.on_hit(r)]
            for group, rows in hit.needed.items()
        }
        await self._persist(hot)

    def _unpin(self, pinned: Mapping[str, list[bytes]]) -> None:
        for group, group_keys in pinned.items():
            self.index.unpin(group, group_keys)

    async def prefetch(self, token_ids: Sequence[int]) -> int:
        """Bring the prompt's L3-only pages into L2 ahead of its load (the engine's hint when a
        request is queued); returns how many pages L2 gained."""
        await self.discover(token_ids)
        hit = self.index.lookup(token_ids, touch=False)
        if hit.pages_total == hit.pages_l2 or self.l3 is None:
            return 0
        before = self.index.lookup(token_ids, touch=False).pages_l2
        await self._fetch(hit)
        return self.index.lookup(token_ids, touch=False).pages_l2 - before

    async def _prefetch(self, hit: Hit, tokens: int) -> None:
        """Bring the hit's L3-only pages into L2, within the prefetch policy's wait; the
        fetch goes on in the background past the wait (best effort: without waiting), so the
        next request for the prefix finds it in L2."""
        if self.l3 is None:
            return
        wait = self.prefetch_policy.wait_s(tokens)
        task = asyncio.ensure_future(self._fetch(hit))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if wait == 0.0:
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), wait)
        except TimeoutError:
            return

    async def flush(self) -> int:
        """Persist every L2 page L3 lacks (what write-back owes at shutdown); returns how many
        were written."""
        owed = {
            group: [r for r in self.index.l2_records(group) if not r.in_l3]
            for group in self.index.rules
        }
        return await self._persist(owed)

    def clear_l2(self) -> int:
        """Drop every unpinned L2 page (the admin API); L3 copies stay findable."""
        dropped = 0
        for group in self.index.rules:
            pool = self.embedded.host_tier.pool(group)
            for record in self.index.l2_records(group):
                if record.pins == 0:
                    pool.allocator.free([self.index.drop_l2(group, record.key)])
                    dropped += 1
        return dropped

    async def clear_l3(self) -> int:
        """Delete every L3 page the index knows of (the admin API); returns how many."""
        if self.l3 is None:
            return 0
        known = [
            (group, record.key)
            for group in self.index.rules
            for record in list(self.index.l3_records(group))
        ]
        await self.l3.delete([key for _, key in known])
        for group, key in known:
            self.index.drop_l3(group, key)
        return len(known)

    async def drain(self) -> None:
        """Wait for background prefetches (shutdown)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def _fetch(self, hit: Hit) -> None:
        assert self.l3 is not None
        for group, rows in hit.needed.items():
            missing = [
                record
                for _, record in rows
                if record.l2_page is None
                and record.in_l3
                and self.index.record(group, record.key) is record  # not forgotten meanwhile
            ]
            if not missing:
                continue
            # pinned while fetched, so that making room (which turns L2 pages into L3-only
            # ones) cannot make the index forget them
            self.index.pin(group, [r.key for r in missing])
            try:
                await self._fetch_group(group, missing)
            finally:
                self.index.unpin(group, [r.key for r in missing])

    async def _fetch_group(self, group: str, missing: list[PageRecord]) -> None:
        assert self.l3 is not None
        pool = self.embedded.host_tier.pool(group)
        await self._make_room(group, len(missing))
        # the payloads land straight in freshly allocated host pages (scatter reads where
        # the backend has them) and are verified there; a page that fails is freed again
        room = pool.allocator.stats().free_pages
        take = missing[:room]  # a concurrent fetch may have taken some of the room
        if not take:
            return
        pages = pool.allocator.alloc(len(take))
        targets = [[c.numpy().data for c in pool.page_chunks(p)] for p in pages]
        try:
            ok, answered = await self.l3.fetch_into([r.key for r in take], targets)
        except BaseException:  # cancelled mid-fetch: the pages were never indexed
            pool.allocator.free(pages)
            raise
        for record, page, good in zip(take, pages, ok, strict=True):
            current = self.index.record(group, record.key)
            if good and current is not None and current.l2_page is None:
                self.index.insert_l2(group, record.key, page)
                continue
            pool.allocator.free([page])
            if not good and answered and current is not None and current.in_l3:
                # L3 answered but has no valid copy: the index's entry is stale
                self.index.drop_l3(group, record.key)
