"""L3 attached and detached at runtime (the admin API's `set_store` -> `attach_l3`) while
engines drive the cache: loads, prefetches, stores, discovering lookups and the persist
worker in flight across every swap. None of them may raise to the caller; an op that finds
L3 gone misses its L3 part (L2 hits still served); what is loaded is byte-exact; pins are
released and the planner, index and allocators agree afterwards; pages queued for a store
that left are dropped and counted, and nothing learnt from an old store is taken as the new
one's.

The layout and prompts are the state machine's (`stateful.py`: sliding, full and linear
groups, prompts sharing prefixes), so every group kind crosses a swap."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from hicache.assembly import by_key
from hicache.cache import TieredCache
from hicache.demo.content import check_page, fill_page, prefix_seed
from hicache.model import LayerMap
from hicache.storage import FileBackend, GuardedStore
from hicache.storage.backend import Buffer
from hicache.testing.faulty_storage import FaultyBackend
from tests.cache.stateful import LAYOUT, PAGE, PROMPTS, lane_pages, state_slot
from tests.cache.test_core import assert_consistent, worker_busy
from tests.test_tiered import build, snapshot, wipe

LANES = 6
MORE = [list(range(2000 + 100 * k, 2000 + 100 * k + 5 * PAGE)) for k in range(4)]
ALL_PROMPTS = [*PROMPTS, *MORE]


def swap_cache(root: Path, prefetch_policy: str = "wait_complete") -> TieredCache:
    embedded = by_key.embedded(
        LayerMap(LAYOUT),
        dtype=torch.float32,
        page_size_tokens=PAGE,
        host_capacity_bytes=1 << 20,  # unused: sized in pages below
        device_pages=16 * LANES,
        host_pages_per_group={"full": 10, "sliding": 8, "linear": 6},
    )
    return by_key.tiered(embedded, store=l3_over(root, seed=0), prefetch_policy=prefetch_policy)


def l3_over(root: Path, seed: int, latency_s: float = 0.0) -> GuardedStore:
    """A fresh store over the L3 directory `root` (what `POST /v1/admin/l3/attach` builds)."""
    faulty = FaultyBackend(
        FileBackend(root, capacity_bytes=1 << 28), seed=seed, vectored=True, latency_s=latency_s
    )
    return GuardedStore(faulty, base_timeout_s=5.0)


class Engine:
    """One engine's lane of device pages: stores what a prefill wrote, loads and checks."""

    def __init__(self, cache: TieredCache, lane: int):
        self.cache = cache
        self.lane = lane
        self.pools = cache.embedded.device_pools
        self.rules = cache.index.rules
        self.loaded_pages = 0

    async def store(self, tokens: list[int]) -> None:
        full = len(tokens) // PAGE
        pages: dict[str, list[int | None]] = {}
        snapshots: dict[str, dict[int, int]] = {}
        for group, rule in self.rules.items():
            pool = self.pools[group]
            if rule.kind.is_token_cache:
                dev = lane_pages(self.lane, False, full)
                for i, page in enumerate(dev):
                    fill_page(pool, page, prefix_seed(tokens, (i + 1) * PAGE, group))
                pages[group] = list(dev)
            else:
                snaps = {}
                for k in range(full):
                    slot = state_slot(self.lane, False, k)
                    fill_page(pool, slot, prefix_seed(tokens, (k + 1) * PAGE, group))
                    snaps[(k + 1) * PAGE] = slot
                snapshots[group] = snaps
        await self.cache.store(tokens, pages, snapshots=snapshots)

    async def load(self, tokens: list[int]) -> None:
        full = len(tokens) // PAGE
        dev = {
            g: lane_pages(self.lane, True, full)
            if r.kind.is_token_cache
            else [state_slot(self.lane, True, 0)]
            for g, r in self.rules.items()
        }
        for group, group_pages in dev.items():  # poison: anything not loaded fails the check
            rows = PAGE if self.rules[group].kind.is_token_cache else 1
            for page in group_pages:
                for layer in self.pools[group].tensors:
                    for t in layer.values():
                        t[page * rows].fill_(-1.0)
        handle, hit = await self.cache.load(tokens, dev)
        if handle is None:
            return
        if not (await handle.done()).ok:
            return  # a failed load is reported, never served
        for group, rows_loaded in hit.needed.items():
            pool = self.pools[group]
            for i, _ in rows_loaded:
                if self.rules[group].kind.is_token_cache:
                    seed = prefix_seed(tokens, (i + 1) * PAGE, group)
                    assert check_page(pool, dev[group][i], seed), (group, i, tokens[:2])
                else:
                    seed = prefix_seed(tokens, hit.tokens_total, group)
                    assert check_page(pool, dev[group][0], seed), (group, hit.tokens_total)
                self.loaded_pages += 1

    async def lookup(self, tokens: list[int]) -> None:
        """The service's lookup: inline, or through discovery when L3 might extend it."""
        hit = self.cache.lookup(tokens)
        if self.cache.needs_discovery(tokens, hit):
            await self.cache.discover(tokens)
        hit = self.cache.lookup(tokens)
        assert hit.tokens_l2 <= hit.tokens_total <= len(tokens)

    async def run(self, rounds: int, rng: random.Random) -> None:
        for _ in range(rounds):
            tokens = rng.choice(ALL_PROMPTS)
            op = rng.random()
            if op < 0.35:
                await self.store(tokens)
            elif op < 0.7:
                await self.load(tokens)
            elif op < 0.85:
                await self.cache.prefetch(tokens)
            else:
                await self.lookup(tokens)
            if rng.random() < 0.1:
                self.cache.clear_l2()  # what is left is only in L3: the next load fetches it
            await asyncio.sleep(0)


async def swapping(cache: TieredCache, roots: list[Path], stop: asyncio.Event) -> int:
    """Attach and detach L3 in a tight loop, closing the store that left (as the admin API
    does); returns how many swaps it made."""
    swaps = 0
    rng = random.Random(7)
    while not stop.is_set():
        old = cache.l3
        if old is None or rng.random() < 0.3:
            new = l3_over(rng.choice(roots), seed=swaps, latency_s=rng.choice([0.0, 0.002]))
        else:
            new = None
        cache.attach_l3(new)
        swaps += 1
        if old is not None:
            await old.backend.close()
        for _ in range(rng.randrange(3)):
            await asyncio.sleep(0)
        if rng.random() < 0.3:
            await asyncio.sleep(0.001)
    return swaps


@pytest.mark.asyncio
@pytest.mark.parametrize("prefetch_policy", ["wait_complete", "timeout", "best_effort"])
async def test_attach_and_detach_under_load_never_raise_and_keep_the_core_consistent(
    tmp_path: Path, prefetch_policy: str
) -> None:
    roots = [tmp_path / "l3-a", tmp_path / "l3-b"]
    cache = swap_cache(roots[0], prefetch_policy)
    try:
        async with cache.running():
            engines = [Engine(cache, lane) for lane in range(LANES)]
            for engine, tokens in zip(engines, ALL_PROMPTS, strict=False):
                await engine.store(tokens)  # something in L2 and L3 before the swaps
            await cache.drain()
            stop = asyncio.Event()
            swapper = asyncio.create_task(swapping(cache, roots, stop))
            rngs = [random.Random(100 + lane) for lane in range(LANES)]
            try:
                await asyncio.gather(*(e.run(60, r) for e, r in zip(engines, rngs, strict=True)))
            finally:
                stop.set()
                swaps = await swapper
            assert swaps > 50
            await cache.drain()
            assert_consistent(cache)
            assert cache.background_errors == 0
            await assert_l3_truthful(cache)
            # after the last swap, L3 is whatever was attached: the cache still serves
            cache.attach_l3(l3_over(roots[0], seed=99))
            for engine, tokens in zip(engines, ALL_PROMPTS, strict=False):
                await engine.store(tokens)
                await engine.load(tokens)
            await cache.drain()
            assert_consistent(cache)
            await assert_l3_truthful(cache)
            assert sum(e.loaded_pages for e in engines) > 0
    finally:
        cache.embedded.close()


async def assert_l3_truthful(cache: TieredCache) -> None:
    """Every page the index says L3 holds, the attached store holds (none when detached):
    nothing learnt from a store that left is taken as the new one's."""
    for group in cache.index.rules:
        keys = [r.key for r in cache.index.l3_records(group)]
        if cache.l3 is None:
            assert not keys, (group, len(keys))
        elif keys:
            present = await cache.l3.exists(keys)
            assert all(present), (group, present.count(False), len(keys))


class Gates(FaultyBackend):
    """A file L3 whose puts, existence checks and reads each wait at their own gate."""

    def __init__(self, root: Path):
        super().__init__(FileBackend(root, capacity_bytes=1 << 30), vectored=True)
        self.put_gate, self.exists_gate, self.read_gate = (asyncio.Event() for _ in range(3))
        for gate in (self.put_gate, self.exists_gate, self.read_gate):
            gate.set()
        self.put_keys: list[bytes] = []
        self.waiting = 0

    async def _at(self, gate: asyncio.Event) -> None:
        self.waiting += 1
        try:
            await gate.wait()
        finally:
            self.waiting -= 1

    async def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        await self._at(self.put_gate)
        self.put_keys += [key for key, _ in items]
        return await super().put_many(items)

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        await self._at(self.exists_gate)
        return await super().exists_many(keys)

    async def get_parts_many(
        self, keys: Sequence[bytes], targets: Sequence[Sequence[memoryview]]
    ) -> list[int]:
        await self._at(self.read_gate)
        return await super().get_parts_many(keys, targets)


async def parked(gates: Gates) -> None:
    """Until some call waits at a closed gate (the deadline bounds a hang only, #26)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if gates.waiting:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("no L3 call reached its gate")


def gated(root: Path) -> tuple[GuardedStore, Gates]:
    gates = Gates(root)
    return GuardedStore(gates, base_timeout_s=30.0), gates


@pytest.mark.asyncio
async def test_a_write_acknowledged_by_a_store_that_left_is_not_marked_in_l3(
    tmp_path: Path,
) -> None:
    """The batch being written when L3 is replaced finishes on the old store; its acks used
    to mark the pages as in L3 — the new one's L3, which never had them: under write-through
    they were then never written there, and a lookup after L2 lost them promised a hit."""
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=8, prefetch_policy="wait_complete")
    old, old_gates = gated(tmp_path / "old")
    new, new_gates = gated(tmp_path / "new")
    cache.attach_l3(old)
    try:
        async with cache.running():
            tokens = list(range(4 * PAGE))
            old_gates.put_gate.clear()
            await cache.store(tokens, {"full": [0, 1, 2, 3]})
            await worker_busy(cache)
            await parked(old_gates)
            cache.attach_l3(new)
            old_gates.put_gate.set()
            await cache.drain()
            assert len(old_gates.put_keys) == 4  # it finished there
            assert new_gates.put_keys == []
            assert not any(r.in_l3 for r in cache.index.l2_records("full"))
            await assert_l3_truthful(cache)
            assert await cache.flush() == 4  # what the new store is owed, it gets
            assert len(new_gates.put_keys) == 4
            await assert_l3_truthful(cache)
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_pages_queued_for_a_store_that_left_are_dropped_and_counted(
    tmp_path: Path,
) -> None:
    """Pages waiting in the persist queue when L3 is detached or replaced were offered for
    the store that left: dropped and counted, never written into its successor."""
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=16)
    old, old_gates = gated(tmp_path / "old")
    new, new_gates = gated(tmp_path / "new")
    cache.attach_l3(old)
    try:
        async with cache.running():
            old_gates.put_gate.clear()
            await cache.store(list(range(4 * PAGE)), {"full": [0, 1, 2, 3]})
            await worker_busy(cache)  # that batch is being written; the next one waits
            await cache.store(list(range(100, 100 + 4 * PAGE)), {"full": [4, 5, 6, 7]})
            cache.attach_l3(None)
            assert cache.persist.stats().detached_pages == 4
            cache.attach_l3(new)
            old_gates.put_gate.set()
            await cache.drain()
            stats = cache.persist.stats()
            assert (stats.written_pages, stats.detached_pages, stats.queued_pages) == (4, 4, 0)
            assert new_gates.put_keys == []
            await assert_l3_truthful(cache)
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_what_the_index_knew_of_l3_goes_with_the_store(tmp_path: Path) -> None:
    """After a detach, pages only the old L3 held were still reported as hits (a lookup
    promised tokens no tier could serve); after attaching another store, pages it lacks.
    Now the marks go with the store; attaching the first one again finds its pages by
    asking it (discovery) and loads them byte-exact."""
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=8, prefetch_policy="wait_complete")
    first = cache.l3
    try:
        async with cache.running():
            tokens = list(range(4 * PAGE))
            want = snapshot(cache, {"full": [0, 1, 2, 3]})
            await cache.store(tokens, {"full": [0, 1, 2, 3]})
            await cache.drain()
            cache.clear_l2()
            assert cache.lookup(tokens).tokens_total == 4 * PAGE  # in L3 only
            cache.attach_l3(None)
            assert cache.lookup(tokens).tokens_total == 0
            handle, hit = await cache.load(tokens, {"full": [4, 5, 6, 7]})
            assert (handle, hit.tokens_total) == (None, 0)
            cache.attach_l3(GuardedStore(FileBackend(tmp_path / "other", capacity_bytes=1 << 20)))
            await cache.discover(tokens)
            assert cache.lookup(tokens).tokens_total == 0
            await assert_l3_truthful(cache)
            cache.attach_l3(first)
            wipe(cache)
            handle, hit = await cache.load(tokens, {"full": [4, 5, 6, 7]})
            assert handle is not None
            assert hit.tokens_total == 4 * PAGE
            assert (await handle.done()).ok
            got = snapshot(cache, {"full": [4, 5, 6, 7]})
            assert all(torch.equal(got[k], want[k]) for k in want)
            await cache.drain()
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_a_discovery_answered_by_a_store_that_left_records_nothing(
    tmp_path: Path,
) -> None:
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=8)
    old, old_gates = gated(tmp_path / "l3")
    cache.attach_l3(old)
    try:
        async with cache.running():
            tokens = list(range(4 * PAGE))
            await cache.store(tokens, {"full": [0, 1, 2, 3]})
            await cache.drain()
            cache.clear_l2()
            cache.attach_l3(None)  # forgets the pages; a discovery would find them again
            cache.attach_l3(old)
            old_gates.exists_gate.clear()
            asking = asyncio.create_task(cache.discover(tokens))
            await parked(old_gates)
            cache.attach_l3(None)
            old_gates.exists_gate.set()
            assert await asking == 0
            assert cache.lookup(tokens).tokens_total == 0
            await assert_l3_truthful(cache)
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_a_load_whose_fetch_outlives_its_store_serves_what_verified(
    tmp_path: Path,
) -> None:
    """A load waits for a fetch from L3; L3 is detached while the read is in flight. The
    read finishes on the store that left, its verified pages are indexed in L2 (the bytes are
    the page's whichever store sent them) and loaded byte-exact; nothing raises."""
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=8, prefetch_policy="wait_complete")
    old, old_gates = gated(tmp_path / "l3")
    cache.attach_l3(old)
    try:
        async with cache.running():
            tokens = list(range(4 * PAGE))
            want = snapshot(cache, {"full": [0, 1, 2, 3]})
            await cache.store(tokens, {"full": [0, 1, 2, 3]})
            await cache.drain()
            cache.clear_l2()
            wipe(cache)
            old_gates.read_gate.clear()
            loading = asyncio.create_task(cache.load(tokens, {"full": [4, 5, 6, 7]}))
            await parked(old_gates)
            cache.attach_l3(None)
            old_gates.read_gate.set()
            handle, hit = await loading
            assert handle is not None
            assert (hit.tokens_total, hit.failed) == (4 * PAGE, {})
            assert (await handle.done()).ok
            got = snapshot(cache, {"full": [4, 5, 6, 7]})
            assert all(torch.equal(got[k], want[k]) for k in want)
            await cache.drain()
            await assert_l3_truthful(cache)
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_after_a_detach_a_load_serves_its_l2_part(tmp_path: Path) -> None:
    """A prompt half in L2, half only in the L3 that was detached: the L2 half is loaded
    byte-exact, the rest is a miss (never promised by lookup, never raised)."""
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=8, prefetch_policy="wait_complete")
    try:
        async with cache.running():
            tokens = list(range(4 * PAGE))
            want = snapshot(cache, {"full": [0, 1, 2, 3]})
            await cache.store(tokens, {"full": [0, 1, 2, 3]})
            await cache.drain()
            cache.clear_l2()
            wipe(cache)
            handle, hit = await cache.load(tokens[: 2 * PAGE], {"full": [4, 5]})  # from L3
            assert handle is not None
            assert (await handle.done()).ok
            cache.attach_l3(None)
            assert cache.lookup(tokens).tokens_total == 2 * PAGE
            handle, hit = await cache.load(tokens, {"full": [4, 5, 6, 7]})
            assert handle is not None
            assert (hit.tokens_total, hit.failed) == (2 * PAGE, {})
            assert (await handle.done()).ok
            got = snapshot(cache, {"full": [4, 5]})
            assert all(torch.equal(got[k], want[k]) for k in got)
            await cache.drain()
            assert_consistent(cache)
    finally:
        cache.embedded.close()
