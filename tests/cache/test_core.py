"""The tier core under concurrency, as a user drives it: regression tests, one per defect the
old single-coroutine `TieredCache` had (concurrent stores of one prefix, write-back stores
pinning each other's victims, an eviction between a load's hit and its pins, lookups counted
as hits, stores failing for capacity under load), plus the new contracts: write-through is
acknowledged at L2 with L3 written behind, a prompt larger than L2 stores its longest prefix,
and L2 is budgeted per group by need."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from hicache.assembly import by_key
from hicache.cache import CacheNotRunningError, TieredCache
from hicache.index.policies import WriteThroughSelective
from hicache.model import LayerMap, load_layout
from hicache.storage import FileBackend, GuardedStore
from hicache.storage.backend import Buffer
from hicache.testing.faulty_storage import FaultyBackend
from tests.conftest import shared_model
from tests.test_tiered import PAGE, build, snapshot


def assert_consistent(cache: TieredCache) -> None:
    """Every pin released, the index and every allocator agree, nothing reserved."""
    cache.planner.check()
    for group in cache.index.rules:
        stats = cache.embedded.host_tier.pool(group).allocator.stats()
        assert stats.pinned_pages == 0, group
        assert cache.index.pinned_pages(group) == 0, group
        assert not cache.planner.pending[group], group
        used = stats.num_pages - stats.free_pages
        assert used == cache.index.l2_pages(group), (group, used, cache.index.l2_pages(group))


class GatedBackend(FaultyBackend):
    """L3 whose puts wait for a gate: what is acknowledged before L3 has the bytes shows."""

    def __init__(self, inner: FileBackend):
        super().__init__(inner)
        self.gate = asyncio.Event()
        self.puts = 0

    async def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        await self.gate.wait()
        self.puts += len(items)
        return await super().put_many(items)


async def worker_busy(cache: TieredCache) -> None:
    """Until the persist worker is writing a batch (it waits at a closed gate then)."""
    deadline = time.monotonic() + 60  # bounds a hang only (#26: a busy machine)
    while time.monotonic() < deadline:
        if cache.persist.writing:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the persist worker never took a batch")


def gated_cache(tmp_path: Path, host_pages: int) -> tuple[TieredCache, GatedBackend]:
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=host_pages)
    gated = GatedBackend(FileBackend(tmp_path / "gated", capacity_bytes=1 << 30))
    cache.attach_l3(GuardedStore(gated, base_timeout_s=30.0))
    return cache, gated


@pytest.mark.asyncio
async def test_ops_outside_running_are_refused(tmp_path: Path) -> None:
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=4)
    try:
        with pytest.raises(
            CacheNotRunningError,
            match=r"^the cache is not running; serve ops inside `async with cache.running\(\):`$",
        ):
            await cache.store(list(range(PAGE)), {"full": [0]})
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_concurrent_stores_of_one_prefix_store_it_once(tmp_path: Path) -> None:
    """Both used to pass the "already known" check; the second raised after its backup was
    acknowledged and leaked its host pages."""
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=16)
    try:
        async with cache.running():
            tokens = list(range(4 * PAGE))
            results = await asyncio.gather(
                *(cache.store(tokens, {"full": [0, 1, 2, 3]}) for _ in range(4))
            )
            assert sum(r.pages_stored for r in results) == 4
            assert cache.lookup(tokens).tokens_l2 == 4 * PAGE
            await cache.drain()
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_concurrent_write_back_stores_do_not_starve_each_other(tmp_path: Path) -> None:
    """Under write-back, concurrent stores used to pin each other's victims until the pool
    was exhausted. Now each store persists the victims it needs, evicts them, and stores."""
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=4, write_policy="write_back")
    try:
        async with cache.running():
            prompts = [list(range(1000 * k, 1000 * k + 2 * PAGE)) for k in range(8)]
            stored = []
            for wave in range(2):
                batch = prompts[4 * wave : 4 * wave + 4]
                results = await asyncio.gather(
                    *(
                        cache.store(p, {"full": [2 * (i % 2), 2 * (i % 2) + 1]})
                        for i, p in enumerate(batch)
                    )
                )
                # 8 pages asked of a 4-page L2 at once: what fits is stored (pages in flight
                # for another store are not victims), the rest is not, and nothing raises
                assert sum(r.pages_stored for r in results) >= 2
                stored += [p for p, r in zip(batch, results, strict=True) if r.pages_stored == 2]
                assert_consistent(cache)
            # nothing stored was lost: evicted write-back pages were persisted first
            assert stored
            assert all(cache.lookup(p).tokens_total == 2 * PAGE for p in stored)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_a_store_evicting_during_a_load_never_fails_it(tmp_path: Path) -> None:
    """A store's eviction between a load's hit computation and its pinning used to fail
    the load with an AssertionError. The load now plans its hit and pins in one step, after
    its awaits; whatever it reports it loads byte-exact."""
    cache, faulty = build(tmp_path, "qwen2_7b.json", host_pages=4, prefetch_policy="wait_complete")
    try:
        async with cache.running():
            tokens = list(range(4 * PAGE))
            want = snapshot(cache, {"full": [0, 1, 2, 3]})
            await cache.store(tokens, {"full": [0, 1, 2, 3]})
            await cache.drain()
            faulty.latency_s = 0.05  # the load's L3 discovery awaits; a store runs meanwhile
            other = list(range(900, 900 + 4 * PAGE))
            longer = [*tokens, *range(50, 50 + 2 * PAGE)]  # pages the index lacks: discovery
            load = asyncio.create_task(cache.load(longer, {"full": [8, 9, 10, 11, 12, 13]}))
            await asyncio.sleep(0.01)
            await cache.store(other, {"full": [4, 5, 6, 7]})  # evicts the loading prompt
            handle, hit = await load
            if handle is not None:
                assert (await handle.done()).ok
                got = snapshot(cache, {"full": [8, 9, 10, 11]})
                for (group, local, t, i), value in got.items():
                    if i < hit.pages_total:
                        assert torch.equal(value, want[(group, local, t, i)])
            faulty.latency_s = 0.0
            await cache.drain()
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_lookups_are_not_hits_loads_are(tmp_path: Path) -> None:
    """Engines look up every waiting request at every step; those probes used to bump hit
    counts and LRU, so write_through_selective persisted pages never reused."""
    cache, gated = gated_cache(tmp_path, host_pages=8)
    cache.write_policy = cache.planner.write_policy = WriteThroughSelective(min_hits=2)
    gated.gate.set()
    try:
        async with cache.running():
            tokens = list(range(2 * PAGE))
            await cache.store(tokens, {"full": [0, 1]})
            for _ in range(10):
                assert cache.lookup(tokens).tokens_l2 == 2 * PAGE
            await cache.drain()
            assert gated.puts == 0  # ten probes: no hit counted, nothing persisted
            for _ in range(2):
                handle, _ = await cache.load(tokens, {"full": [4, 5]})
                assert handle is not None
                assert (await handle.done()).ok
            await cache.drain()
            assert gated.puts == 2  # reused twice: now worth L3
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_write_through_is_acknowledged_at_l2_and_written_behind(tmp_path: Path) -> None:
    """L3 off the critical path: a store returns once L2 holds the pages, and a load of
    them does not wait for the write either."""
    cache, gated = gated_cache(tmp_path, host_pages=8)
    try:
        async with cache.running():
            tokens = list(range(3 * PAGE))
            result = await cache.store(tokens, {"full": [0, 1, 2]})
            assert (result.pages_stored, result.pages_queued) == (3, 3)
            assert gated.puts == 0  # L3 has nothing yet: the gate is closed
            handle, hit = await cache.load(tokens, {"full": [4, 5, 6]})
            assert handle is not None
            assert hit.tokens_total == 3 * PAGE
            assert (await handle.done()).ok
            gated.gate.set()
            await cache.drain()
            assert gated.puts == 3
            assert cache.persist.stats().written_pages == 3
            assert all(r.in_l3 for r in cache.index.l2_records("full"))
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_a_full_persist_queue_drops_and_counts(tmp_path: Path) -> None:
    cache, gated = gated_cache(tmp_path, host_pages=16)
    cache.persist.max_pages = 2
    try:
        async with cache.running():
            await cache.store(list(range(4 * PAGE)), {"full": [0, 1, 2, 3]})
            await worker_busy(cache)  # it took the first batch and waits at the gate
            await cache.store(list(range(100, 100 + 4 * PAGE)), {"full": [4, 5, 6, 7]})
            # each store offered 4 pages to a queue with room for 2: 2 taken, 2 dropped
            assert cache.persist.stats().dropped_pages == 4
            gated.gate.set()
            await cache.drain()
            assert cache.persist.stats().written_pages == 4
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_a_prompt_larger_than_l2_stores_its_longest_prefix(tmp_path: Path) -> None:
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=4, device_token_pages=16)
    try:
        async with cache.running():
            tokens = list(range(10 * PAGE))
            result = await cache.store(tokens, {"full": list(range(10))})
            assert result.pages_stored == 4
            assert result.truncated_to_tokens == 4 * PAGE
            assert cache.lookup(tokens).tokens_l2 == 4 * PAGE
            await cache.drain()
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_many_engines_on_a_small_l2_never_see_a_capacity_error(tmp_path: Path) -> None:
    """8 engines storing and loading against a small L2 with a slow L3 used to get
    `host pool 'full': 3 pages asked for, 2 of 40 free` (a background fetch took the room
    eviction freed for the store). Capacity is the service's problem: stores shrink to what
    fits, loads to what is there, and every loaded byte is right."""
    cache, faulty = build(
        tmp_path,
        "qwen2_7b.json",
        host_pages=10,
        device_token_pages=64,
        prefetch_policy="best_effort",
    )
    faulty.latency_s = 0.002
    rng = random.Random(7)
    try:
        async with cache.running():

            async def engine(e: int) -> None:
                base = 8 * e
                for _step in range(12):
                    first = 10_000 * rng.randrange(6)
                    prompt = list(range(first, first + 3 * PAGE))
                    await cache.store(prompt, {"full": [base, base + 1, base + 2]})
                    handle, _ = await cache.load(prompt, {"full": [base + 3, base + 4, base + 5]})
                    if handle is not None:
                        assert (await handle.done()).ok
                    await asyncio.sleep(0)

            await asyncio.gather(*(engine(e) for e in range(8)))
            await cache.drain()
            assert cache.background_errors == 0
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_full_attention_only_caches_the_full_group_alone(tmp_path: Path) -> None:
    """Under `full_attention_only` the engine recomputes every other group: the cache keeps
    no page of them. Before, their host pages were reserved, never written, and indexed
    (and persisted) as valid."""
    layer_map = LayerMap(load_layout(shared_model("gpt_oss_20b.json")))
    embedded = by_key.embedded(
        layer_map,
        dtype=torch.float16,
        page_size_tokens=PAGE,
        host_capacity_bytes=8 << 20,
        device_pages=16,
        move_policy="full_attention_only",
    )
    cache = by_key.tiered(embedded)
    try:
        async with cache.running():
            tokens = list(range(4 * PAGE))
            pages = {"full": [0, 1, 2, 3], "sliding": [0, 1, 2, 3]}
            want = snapshot(cache, {"full": [0, 1, 2, 3]})
            result = await cache.store(tokens, pages)
            assert result.pages_stored == 4
            assert set(cache.index.rules) == {"full"}
            handle, hit = await cache.load(
                tokens, {"full": [8, 9, 10, 11], "sliding": [8, 9, 10, 11]}
            )
            assert hit.tokens_total == 4 * PAGE
            assert handle is not None
            assert (await handle.done()).ok
            got = snapshot(cache, {"full": [8, 9, 10, 11]})
            assert all(torch.equal(got[k], want[k]) for k in want)
            assert_consistent(cache)
    finally:
        embedded.close()


@pytest.mark.asyncio
async def test_a_key_stored_again_while_its_old_record_is_queued_reaches_l3(
    tmp_path: Path,
) -> None:
    """The queue deduplicated by key, the worker wrote a record: a prompt cleared from L2
    while queued and stored again was never written to L3."""
    cache, gated = gated_cache(tmp_path, host_pages=16)
    try:
        async with cache.running():
            first = list(range(4 * PAGE))
            await cache.store(first, {"full": [0, 1, 2, 3]})
            await worker_busy(cache)  # it took that batch and waits at the gate
            again = list(range(100, 100 + 4 * PAGE))
            await cache.store(again, {"full": [4, 5, 6, 7]})  # queued behind it
            assert cache.clear_l2() == 4  # the queued prompt leaves L2 (the batch is pinned)
            result = await cache.store(again, {"full": [4, 5, 6, 7]})
            assert (result.pages_stored, result.pages_queued) == (4, 4)
            gated.gate.set()
            await cache.drain()
            assert all(r.in_l3 for _, r in cache.lookup(again).needed["full"])
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_extending_a_cached_prompt_never_evicts_its_prefix(tmp_path: Path) -> None:
    """A store counted its own prompt's cached prefix as room: extending a prompt on a full
    L2 evicted the prefix and kept a suffix nothing can hit."""
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=4)
    cache.attach_l3(None)
    try:
        async with cache.running():
            prefix = list(range(4 * PAGE))
            await cache.store(prefix, {"full": [0, 1, 2, 3]})
            longer = [*prefix, *range(500, 500 + 2 * PAGE)]
            result = await cache.store(longer, {"full": [0, 1, 2, 3, 4, 5]})
            assert result.pages_stored == 0
            assert result.truncated_to_tokens == 4 * PAGE
            assert cache.lookup(longer).tokens_l2 == 4 * PAGE
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_write_back_storing_a_cached_prompt_again_evicts_nothing(tmp_path: Path) -> None:
    """Write-back victims were sized by every page a store named, known ones included."""
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=8, write_policy="write_back")
    try:
        async with cache.running():
            a, b = list(range(4 * PAGE)), list(range(300, 300 + 4 * PAGE))
            await cache.store(a, {"full": [0, 1, 2, 3]})
            await cache.store(b, {"full": [4, 5, 6, 7]})
            again = await cache.store(b, {"full": [4, 5, 6, 7]})
            assert (again.pages_stored, again.pages_evicted) == (0, 0)
            assert cache.lookup(a).tokens_l2 == 4 * PAGE
            assert_consistent(cache)
    finally:
        cache.embedded.close()
