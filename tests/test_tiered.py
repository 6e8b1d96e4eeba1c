"""The tiered cache end to end on CPU with a file L3: store, evict from L2, find in L3,
prefetch and load back byte-exact; a dead L3 shortens the hit instead of raising."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from hicache.assembly import by_key
from hicache.cache import TieredCache
from hicache.index import AbsentKeys
from hicache.memory import GroupGeometry
from hicache.model import LayerMap, load_layout
from hicache.storage import FileBackend, GuardedStore
from hicache.testing.faulty_storage import FaultyBackend
from tests.conftest import shared_model
from tests.pages import split_store

PAGE = 4


def build(
    tmp_path: Path, config: str, host_pages: int, device_token_pages: int = 16, **kwargs
) -> tuple[TieredCache, FaultyBackend]:  # type: ignore[no-untyped-def]
    layer_map = LayerMap(load_layout(shared_model(config)))
    geoms = [GroupGeometry(g, torch.float16, PAGE) for g in layer_map.groups]
    per_page = sum(g.page_bytes for g in geoms)
    embedded = by_key.embedded(
        layer_map,
        dtype=torch.float16,
        page_size_tokens=PAGE,
        host_capacity_bytes=host_pages * per_page,
        device_pages={
            g.name: device_token_pages if g.group.kind.is_token_cache else 4 for g in geoms
        },
    )
    faulty = FaultyBackend(FileBackend(tmp_path / "l3", capacity_bytes=1 << 30))
    cache = by_key.tiered(embedded, store=GuardedStore(faulty), **kwargs)
    # no test of this builder is about the store's call timeout (1 s by default): generous,
    # so an L3 call a busy machine delays is not a failed load (#26)
    cache.l3.base_timeout_s = 30.0  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(0)
    for pool in embedded.device_pools.values():
        for layer in pool.tensors:
            for t in layer.values():
                t.view(-1).view(torch.uint8).copy_(
                    torch.randint(0, 256, (t.numel() * 2,), dtype=torch.uint8, generator=gen)
                )
    return cache, faulty


def snapshot(
    cache: TieredCache, pages: dict[str, list[int]]
) -> dict[tuple[str, int, int, int], torch.Tensor]:
    out = {}
    for group, page_ids in pages.items():
        pool = cache.embedded.device_pools[group]
        for local in range(pool.geometry.num_layers):
            for t, rows in enumerate(pool.layer_rows(local)):
                for i, page in enumerate(page_ids):
                    out[(group, local, t, i)] = rows[page].clone()
    return out


def split_args(cache: TieredCache, tokens: list[int], pages: dict[str, list[int]]):  # type: ignore[no-untyped-def]
    device, snapshots = split_store(
        {g: r.kind for g, r in cache.index.rules.items()}, tokens, pages, PAGE
    )
    return {"device_pages": device, "snapshots": snapshots}


def wipe(cache: TieredCache) -> None:
    for pool in cache.embedded.device_pools.values():
        for layer in pool.tensors:
            for t in layer.values():
                t.zero_()


@pytest.mark.asyncio
@pytest.mark.parametrize("model", ["qwen3_next_80b.json", "gpt_oss_20b.json"])
async def test_store_evict_prefetch_load_byte_exact(tmp_path: Path, model: str) -> None:
    cache, _ = build(tmp_path, model, host_pages=6, prefetch_policy="wait_complete")
    try:
        async with cache.running():
            tokens = list(range(5 * PAGE))  # 5 full pages
            src = {
                g: [3, 1, 4, 0, 2] if cache.index.rules[g].kind.is_token_cache else [1]
                for g in cache.index.rules
            }
            want = snapshot(cache, src)
            stored = await cache.store(tokens, **split_args(cache, tokens, src))
            assert stored.pages_queued == stored.pages_stored > 0  # write-through, behind the ack
            await cache.drain()
            assert cache.lookup(tokens).tokens_l2 == 5 * PAGE
            # another prompt fills L2: the first one's pages are evicted to make room
            other = list(range(1000, 1000 + 5 * PAGE))
            await cache.store(
                other,
                **split_args(
                    cache,
                    other,
                    {
                        g: [5, 6, 7, 8, 9] if cache.index.rules[g].kind.is_token_cache else [2]
                        for g in cache.index.rules
                    },
                ),
            )
            # its pages are being written to L3 behind the ack: until then none of them can
            # make room for a fetch (L3 reads them), so let the writes land
            await cache.drain()
            hit = cache.lookup(tokens)
            assert hit.pages_total == 5
            assert hit.pages_l2 < 5  # partly or wholly only in L3 now
            wipe(cache)
            dst = {
                g: [10, 11, 12, 13, 14] if cache.index.rules[g].kind.is_token_cache else [3]
                for g in cache.index.rules
            }
            handle, loaded = await cache.load(tokens, dst)
            assert handle is not None
            assert loaded.pages_total == 5
            result = await handle.done()
            assert result.ok, result.error
            got = snapshot(cache, dst)
            compared = 0
            for (group, local, t, i), value in got.items():
                token_group = cache.index.rules[group].kind.is_token_cache
                positions = [pos for pos, _ in loaded.needed[group]]
                # a state group's one slot holds the snapshot at the hit's boundary
                if (i in positions) if token_group else bool(positions):
                    assert torch.equal(value, want[(group, local, t, i)]), (group, local, t, i)
                    compared += 1
            groups_compared = {g for (g, _, _, _) in got if cache.index.rules[g]}
            assert compared > 0
            assert groups_compared == set(cache.index.rules)
            for group, rows in loaded.needed.items():
                assert rows, f"group {group} moved nothing"
            await asyncio.sleep(0)
            for group in cache.index.rules:  # load pins released when it finished
                assert all(r.pins == 0 for _, r in loaded.needed[group])
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_dead_l3_shortens_the_hit_without_raising(tmp_path: Path) -> None:
    cache, faulty = build(tmp_path, "qwen2_7b.json", host_pages=4, prefetch_policy="wait_complete")
    try:
        async with cache.running():
            first = list(range(3 * PAGE))
            await cache.store(first, {"full": [0, 1, 2]})
            await cache.store(list(range(500, 500 + 3 * PAGE)), {"full": [3, 4, 5]})  # evicts
            await cache.drain()  # the writes behind the acks land before L3 goes down
            assert cache.lookup(first).pages_total == 3
            faulty.down = True
            # L2 kept only the first prompt's page 2 (LRU evicted 0 and 1): no usable L2 prefix,
            # and L3 is down, so the hit shrinks to nothing instead of raising
            handle, loaded = await cache.load(first, {"full": [6, 7, 8]})
            assert handle is None
            assert loaded.pages_total == 0
            assert loaded.failed == {"full": (0, 1)}  # the pages L3 should have supplied
            assert cache.l3 is not None
            assert cache.l3.stats.failures  # the failure was counted, not raised
            faulty.down = False
            cache.l3.breaker.success()  # back up (the breaker's timing is tested elsewhere)
            handle, loaded = await cache.load(first, {"full": [6, 7, 8]})
            assert loaded.pages_total == 3
            assert loaded.failed == {}
            assert handle is not None
            assert (await handle.done()).ok
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_tenants_never_share_pages(tmp_path: Path) -> None:
    a, _ = build(tmp_path / "a", "qwen2_7b.json", host_pages=4, tenant_salt="tenant-a")
    b, _ = build(tmp_path / "b", "qwen2_7b.json", host_pages=4, tenant_salt="tenant-b")
    try:
        tokens = list(range(2 * PAGE))
        assert a.index.keys(tokens)["full"] != b.index.keys(tokens)["full"]
    finally:
        a.embedded.close()
        b.embedded.close()


@pytest.mark.asyncio
async def test_pages_persisted_before_a_restart_are_found_and_loaded(tmp_path: Path) -> None:
    tokens = list(range(4 * PAGE))
    first, _ = build(tmp_path, "qwen2_7b.json", host_pages=6)
    try:
        async with first.running():
            want = snapshot(first, {"full": [0, 1, 2, 3]})
            stored = await first.store(tokens, {"full": [0, 1, 2, 3]})
            assert stored.pages_queued == 4
            await first.drain()
    finally:
        first.embedded.close()
    # a new process over the same L3 directory: empty index, empty host tier
    second, _ = build(tmp_path, "qwen2_7b.json", host_pages=6, prefetch_policy="wait_complete")
    try:
        assert second.lookup(tokens).pages_total == 0  # the index alone knows nothing
        async with second.running():
            wipe(second)
            handle, loaded = await second.load(tokens, {"full": [8, 9, 10, 11]})
            assert loaded.pages_total == 4
            assert handle is not None
            assert (await handle.done()).ok
            got = snapshot(second, {"full": [8, 9, 10, 11]})
            assert all(torch.equal(got[k], want[k]) for k in want)
    finally:
        second.embedded.close()


@pytest.mark.asyncio
async def test_a_page_the_index_forgot_is_found_again_in_l3(tmp_path: Path) -> None:
    """The index remembers two L3-only pages per group here: storing more forgets the older
    ones, and a lookup of a forgotten prompt asks L3 (discovery) and loads it byte-exact."""
    cache, _ = build(
        tmp_path,
        "qwen2_7b.json",
        host_pages=2,
        prefetch_policy="wait_complete",
        l3_index_max_pages=2,
    )
    try:
        async with cache.running():
            first = list(range(2 * PAGE))
            want = snapshot(cache, {"full": [0, 1]})
            await cache.store(first, {"full": [0, 1]})
            for n in range(3):  # each evicts the previous prompt's pages from L2 into L3 only
                other = list(range(100 * (n + 1), 100 * (n + 1) + 2 * PAGE))
                await cache.store(other, {"full": [2 + 2 * n, 3 + 2 * n]})
            assert cache.index.l3_only_pages("full") == 2
            assert cache.index.l3_forgotten["full"] >= 2
            keys = cache.index.keys(first)["full"]
            assert all(cache.index.record("full", k) is None for k in keys)  # forgotten
            wipe(cache)
            handle, loaded = await cache.load(first, {"full": [10, 11]})
            assert handle is not None
            assert loaded.pages_total == 2
            assert (await handle.done()).ok
            got = snapshot(cache, {"full": [10, 11]})
            for (group, local, t, i), value in got.items():
                assert torch.equal(value, want[(group, local, t, i)]), (group, local, t, i)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_l3_saying_absent_spares_asking_again_for_a_while(tmp_path: Path) -> None:
    """A scheduler looks up a waiting request's prompt at every step: after L3 said it lacks
    the pages, lookups within the TTL do not ask again; after it, or after an answer that
    never came (L3 down), they do."""
    cache, faulty = build(tmp_path, "qwen2_7b.json", host_pages=4)
    now = [100.0]
    cache.discovery.absent = AbsentKeys(2.0, clock=lambda: now[0])
    try:
        async with cache.running():
            cold = list(range(7000, 7000 + 3 * PAGE))
            assert cache.needs_discovery(cold, cache.lookup(cold))
            calls = faulty.calls
            assert await cache.discover(cold) == 0
            assert faulty.calls == calls + 1  # one exists() for the three pages
            assert not cache.needs_discovery(cold, cache.lookup(cold))
            assert await cache.discover(cold) == 0
            assert faulty.calls == calls + 1  # not asked again
            assert cache.discovery.absent.skipped == 3
            now[0] += 2.5  # the answer is stale: ask again
            assert cache.needs_discovery(cold, cache.lookup(cold))
            faulty.down = True
            await cache.discover(cold)
            now[0] += 0.1
            assert cache.needs_discovery(cold, cache.lookup(cold))  # a failure taught nothing
    finally:
        cache.embedded.close()


def build_rank(
    tmp_path: Path, tp_rank: int, host_pages: int, write_policy: str
) -> tuple[TieredCache, FileBackend]:
    """One rank of DeepSeek-V3.2 at tp_size 2 (its latent + index keys: one replicated group)
    on the file L3 every rank shares."""
    from hicache.model import shard_layout

    layer_map = LayerMap(shard_layout(load_layout(shared_model("deepseek_v32_exp.json")), 2))
    [geom] = [GroupGeometry(g, torch.float16, PAGE) for g in layer_map.groups]
    assert geom.group.replicated
    embedded = by_key.embedded(
        layer_map,
        dtype=torch.float16,
        page_size_tokens=PAGE,
        host_capacity_bytes=host_pages * geom.page_bytes,
        device_pages=16,
        tp_rank=tp_rank,
    )
    backend = FileBackend(tmp_path / "l3", capacity_bytes=1 << 30)
    cache = by_key.tiered(
        embedded,
        store=GuardedStore(backend),
        write_policy=write_policy,
        prefetch_policy="wait_complete",
        tp_rank=tp_rank,
    )
    gen = torch.Generator().manual_seed(tp_rank)
    for pool in embedded.device_pools.values():
        for layer in pool.tensors:
            for t in layer.values():
                t.view(torch.uint8).copy_(
                    torch.randint(
                        0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen
                    )
                )
    return cache, backend


@pytest.mark.asyncio
async def test_write_back_on_another_rank_never_holds_replicated_pages_for_l3(
    tmp_path: Path,
) -> None:
    """Rank 1 under write-back stores replicated pages it never writes (rank 0 does): they are
    clean there, so a fetch of rank 0's objects can evict them instead of finding no room."""
    rank0, _ = build_rank(tmp_path, 0, host_pages=8, write_policy="write_through")
    rank1, _ = build_rank(tmp_path, 1, host_pages=4, write_policy="write_back")
    group = rank1.embedded.layer_map.groups[0].name
    theirs = list(range(9000, 9000 + 4 * PAGE))  # rank 0 stores and writes it to L3
    ours = list(range(100, 100 + 4 * PAGE))  # rank 1's own: fills its L2
    try:
        async with rank0.running(), rank1.running():
            await rank0.store(theirs, {group: [0, 1, 2, 3]})
            await rank0.drain()
            await rank1.store(ours, {group: [4, 5, 6, 7]})
            assert rank1.lookup(ours).pages_l2 == 4  # L2 is full of pages L3 lacks
            assert rank1.io.replica_skipped_pages == 0  # nothing offered to L3 yet
            assert await rank1.discover(theirs) == 4  # keyed as rank 0's: its objects
            hit = rank1.lookup(theirs)
            assert hit.pages_total == 4
            assert hit.pages_l2 == 0  # only in L3, written by rank 0
            handle, loaded = await rank1.load(theirs, {group: [8, 9, 10, 11]})
            assert handle is not None, "rank 1 found no room for rank 0's pages"
            assert loaded.pages_total == 4
            assert (await handle.done()).ok
            src = rank0.embedded.device_pools[group]
            dst = rank1.embedded.device_pools[group]
            for local in range(src.geometry.num_layers):
                for a, b in zip(src.layer_rows(local), dst.layer_rows(local), strict=True):
                    assert torch.equal(a[0:4], b[8:12])  # rank 0's bytes, exactly
    finally:
        rank0.embedded.close()
        rank1.embedded.close()


@pytest.mark.asyncio
async def test_rank_0_writes_replicated_pages_through_and_rank_1_never_trusts_an_old_absent(
    tmp_path: Path,
) -> None:
    """The order SGLang's MLA ranks run in: rank 1 asks L3 for a prompt first (a miss, its
    "absent" remembered), then rank 0 stores it under write-back. Rank 0 writes the
    replicated group through all the same (the other ranks read it from L3 only), and rank
    1's next lookup asks L3 again instead of trusting the "absent" it was told moments ago."""
    rank0, _ = build_rank(tmp_path, 0, host_pages=8, write_policy="write_back")
    rank1, _ = build_rank(tmp_path, 1, host_pages=8, write_policy="write_back")
    group = rank1.embedded.layer_map.groups[0].name
    tokens = list(range(500, 500 + 4 * PAGE))
    try:
        async with rank0.running(), rank1.running():
            assert await rank1.discover(tokens) == 0  # L3 lacks it: "absent", remembered
            assert rank1.discovery.absent.fresh(group, rank1.index.keys(tokens)[group][0])
            stored = await rank0.store(tokens, {group: [0, 1, 2, 3]})
            assert stored.pages_queued == 4  # offered to L3 although the policy is write-back
            await rank0.drain()
            assert rank1.needs_discovery(tokens, rank1.lookup(tokens))
            assert await rank1.discover(tokens) == 4
            assert rank1.discovery.absent.asked_again == 4
            assert rank1.lookup(tokens).pages_total == 4
    finally:
        rank0.embedded.close()
        rank1.embedded.close()
