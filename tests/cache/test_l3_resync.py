"""After an L3 outage the backend may come back empty (a Mooncake master or a Redis without
persistence restarted): the cache checks what L3 still holds (`hicache/cache/resync.py`),
stops promising what it lost, and persists again what L2 still holds — so the hot set is back
in L3 without every prefix being recomputed first. A run that L3 stops answering changes
nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.cache import TieredCache
from hicache.cache.resync import REWRITE_ROUNDS
from hicache.testing.faulty_storage import FaultyBackend
from tests.test_tiered import PAGE, build, snapshot, wipe

A = list(range(3 * PAGE))
B = list(range(500, 500 + 3 * PAGE))
C = list(range(900, 900 + 3 * PAGE))


async def outage_that_lost_everything(cache: TieredCache, faulty: FaultyBackend) -> None:
    """The breaker opens, the server restarts empty, a call succeeds: the breaker closes."""
    assert cache.l3 is not None
    breaker = cache.l3.breaker
    for _ in range(breaker.failure_threshold):
        breaker.failure("get:TierUnavailableError: master down")
    keys = [r.key for group in cache.index.rules for r in cache.index.l3_records(group)]
    await faulty.inner.delete_many(keys)  # what the restarted server no longer has
    assert not any(await faulty.exists_many(keys))
    breaker.success()
    assert breaker.outages == 1


@pytest.mark.asyncio
async def test_after_an_outage_what_l3_lost_is_put_back_from_l2_and_never_promised(
    tmp_path: Path,
) -> None:
    cache, faulty = build(tmp_path, "qwen2_7b.json", host_pages=6, prefetch_policy="wait_complete")
    try:
        async with cache.running():
            pages = {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7, 8]}
            for i, prompt in enumerate((A, B, C)):
                await cache.store(prompt, {"full": pages[i]})
            await cache.drain()
            assert cache.index.l3_pages("full") == 9
            held = [i for i, t in enumerate((A, B, C)) if cache.lookup(t).pages_l2 == 3]
            (gone,) = {0, 1, 2} - set(held)  # L2 holds 6 pages: one prompt is L3 only
            kept = held[0]
            prompts = (A, B, C)
            want = snapshot(cache, {"full": pages[kept]})
            assert cache.lookup(prompts[gone]).pages_total == 3
            await outage_that_lost_everything(cache, faulty)
            cache.lookup(A)  # the first op after the outage starts the check
            await cache.drain()
            stats = cache.resync.stats()
            assert (stats.runs, stats.checked, stats.lost, stats.requeued) == (1, 9, 9, 6)
            assert stats.stopped == 0
            # the L3-only prompt is gone from every tier: not promised (a load would miss)
            assert cache.lookup(prompts[gone]).pages_total == 0
            # the others are in L3 again, written from L2: an L2 wipe loses nothing
            assert cache.index.l3_pages("full") == 6
            keys = [r.key for r in cache.index.l2_records("full")]
            assert all(await faulty.exists_many(keys))
            assert cache.clear_l2() == 6
            wipe(cache)
            handle, hit = await cache.load(prompts[kept], {"full": pages[kept]})
            assert hit.pages_total == 3
            assert handle is not None
            assert (await handle.done()).ok
            got = snapshot(cache, {"full": pages[kept]})
            assert all(got[k].equal(v) for k, v in want.items())
            cache.lookup(A)  # no new outage: no new run
            await cache.drain()
            assert cache.resync.stats().runs == 1
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_a_check_l3_does_not_answer_changes_nothing_and_is_tried_again(
    tmp_path: Path,
) -> None:
    cache, faulty = build(tmp_path, "qwen2_7b.json", host_pages=6, prefetch_policy="wait_complete")
    try:
        async with cache.running():
            await cache.store(A, {"full": [0, 1, 2]})
            await cache.drain()
            assert cache.l3 is not None
            breaker = cache.l3.breaker
            for _ in range(breaker.failure_threshold):
                breaker.failure("get:timeout")
            breaker.success()
            faulty.down = True  # down again before the check can ask
            cache.lookup(A)
            await cache.drain()
            stats = cache.resync.stats()
            assert (stats.runs, stats.checked, stats.lost, stats.stopped) == (1, 0, 0, 1)
            assert cache.index.l3_pages("full") == 3  # an outage forgets nothing
            now = [0.0]
            cache.resync.clock = lambda: now[0]
            cache.resync._not_before = 5.0  # the pause after a run L3 did not answer
            faulty.down = False
            cache.l3.breaker.success()  # one failure does not open the breaker: no new outage
            keys = [r.key for r in cache.index.l3_records("full")]
            await faulty.inner.delete_many(keys)  # and L3 had come back empty
            cache.lookup(A)
            await cache.drain()
            assert cache.resync.stats().runs == 1  # not at every op: after the pause
            now[0] = 5.0
            cache.lookup(A)
            await cache.drain()
            stats = cache.resync.stats()
            assert (stats.runs, stats.checked, stats.lost, stats.requeued) == (2, 3, 3, 3)
            assert all(await faulty.exists_many(keys))  # written again from L2
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_a_store_attached_later_is_not_checked_for_outages_before_it(
    tmp_path: Path,
) -> None:
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=6)
    try:
        async with cache.running():
            store = cache.l3
            assert store is not None
            cache.attach_l3(None)
            for _ in range(store.breaker.failure_threshold):
                store.breaker.failure("get:timeout")
            store.breaker.success()
            cache.attach_l3(store)  # its past outage: the index starts empty of it anyway
            cache.lookup(A)
            await cache.drain()
            assert cache.resync.stats().runs == 0
    finally:
        cache.embedded.close()


async def three_prompts_then_an_empty_restart(cache: TieredCache, faulty: FaultyBackend) -> None:
    """A, B and C stored (9 pages, 6 of them still in L2), then an outage that lost them all."""
    for i, prompt in enumerate((A, B, C)):
        await cache.store(prompt, {"full": [3 * i, 3 * i + 1, 3 * i + 2]})
    await cache.drain()
    await outage_that_lost_everything(cache, faulty)


@pytest.mark.asyncio
async def test_a_store_that_takes_reads_before_writes_gets_the_pages_on_a_later_round(
    tmp_path: Path,
) -> None:
    """A restarted Mooncake master answers `exists` before its clients have mounted their
    segments again, and refuses every put as "no space" until then: the first rewrite writes
    nothing. The pages L2 still holds are offered again after the pause, and reach L3."""
    cache, faulty = build(tmp_path, "qwen2_7b.json", host_pages=6, prefetch_policy="wait_complete")
    cache.resync.retry_after_s = 0.05
    try:
        async with cache.running():
            await three_prompts_then_an_empty_restart(cache, faulty)
            faulty.drop_rate = 1.0  # every put "not stored"
            failed_before = cache.persist.stats().failed_pages
            cache.lookup(A)
            while cache.persist.stats().failed_pages < failed_before + 6:
                await cache.persist.next_change()  # a batch ended: the first rewrite failed
            faulty.drop_rate = 0.0  # the segments are mounted again
            await cache.drain()
            stats = cache.resync.stats()
            assert (stats.lost, stats.requeued, stats.rewrites, stats.unwritten) == (9, 6, 6, 0)
            assert cache.index.l3_pages("full") == 6
            keys = [r.key for r in cache.index.l2_records("full")]
            assert all(await faulty.exists_many(keys))
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_pages_a_store_never_takes_are_offered_a_bounded_number_of_times(
    tmp_path: Path,
) -> None:
    cache, faulty = build(tmp_path, "qwen2_7b.json", host_pages=6, prefetch_policy="wait_complete")
    cache.resync.retry_after_s = 0.01
    try:
        async with cache.running():
            await three_prompts_then_an_empty_restart(cache, faulty)
            faulty.drop_rate = 1.0  # L3 full for good
            cache.lookup(A)
            await cache.drain()  # ends: the rounds are bounded
            stats = cache.resync.stats()
            assert (stats.requeued, stats.rewrites, stats.unwritten) == (6, 6 * REWRITE_ROUNDS, 6)
            # nothing promised that L3 lacks; L2 still serves the six pages
            assert cache.index.l3_pages("full") == 0
            assert len(cache.index.l2_records("full")) == 6
            assert not cache.resync.running
    finally:
        cache.embedded.close()
