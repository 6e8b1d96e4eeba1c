"""The scheduler end to end on CPU: byte-exact loads and backups through real hybrid layouts,
concurrency, cancellation, deadlines (fake clock), injected faults, per-layer release,
backpressure, guard errors and shutdown."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from hicache.errors import LayerIdError, LayerOutsideStageError, UnknownLayerError
from hicache.scheduler import (
    FakeClock,
    GroupPages,
    OpRequestError,
    OpState,
    SchedulerClosedError,
)
from hicache.testing.fake_copies import FakeCopyBackend
from tests.scheduler.conftest import (
    PAGE,
    assert_pinned_none,
    gate_opened_on_exit,
    pages_for,
    snapshot_pages,
    stack,
)

MODELS = [
    "qwen2_7b.json",  # plain full attention
    "gpt_oss_20b.json",  # sliding + full
    "qwen3_next_80b.json",  # linear + full
    "jamba_v01.json",  # mamba + full
    "deepseek_v32_exp.json",  # MLA sparse + index K
    "falcon_h1_7b.json",  # parallel attention + mamba in one layer
    "gemma3n_e4b.json",  # KV-sharing layers own nothing
]


@pytest.mark.asyncio
@pytest.mark.parametrize("model", MODELS)
async def test_backup_then_load_is_byte_exact(model: str) -> None:
    with stack(model) as cache:
        async with cache.scheduler.running() as sched:
            src = pages_for(cache, [5, 1, 6], state_page=2)
            want = snapshot_pages(cache, src)
            backup = await sched.backup(src)
            result = await backup.done()
            assert result.state is OpState.DONE, result.error
            # wipe the device, then load into other pages in the order of the prefix
            for pool in cache.device_pools.values():
                for layer in pool.tensors:
                    for t in layer.values():
                        t.zero_()
            dst_pages = [0, 7, 3]
            load_req = {}
            for name, gp in src.items():
                hosts = result.groups[name].host_pages
                dst = tuple(dst_pages) if len(gp.device_pages) > 1 else (0,)
                load_req[name] = GroupPages(dst, hosts, num_tokens=len(dst) * PAGE)
            handle = await sched.load(load_req)
            for layer_id in sched.layer_map.stage_layer_ids:
                await asyncio.to_thread(handle.wait_layer, layer_id)
            loaded = await handle.done()
            assert loaded.state is OpState.DONE, loaded.error
            got = snapshot_pages(cache, load_req)
            # sliding groups load only the window's tail; everything loaded equals the source
            for key, value in got.items():
                name, _, _, i = key
                moved = load_req[name].device_pages[i] in loaded.groups[name].moved_device_pages
                if moved:
                    assert torch.equal(value, want[key]), key
                else:
                    assert int(value.abs().max()) == 0, key
        assert_pinned_none(cache)
        stats = sched.stats()
        assert stats.ops_by_state == {"done": 2}
        assert stats.load.bytes == loaded.bytes_moved > 0


@pytest.mark.asyncio
async def test_sliding_window_moves_only_the_tail_and_full_only_policy() -> None:
    with stack("gpt_oss_20b.json", token_pages=80, host_pages=80) as cache:
        async with cache.scheduler.running() as sched:
            pages = list(range(70))  # 140 tokens with window 128: tokens 12..139 are needed
            backup = await (await sched.backup(pages_for(cache, pages, 0))).done()
            req = {
                n: GroupPages(tuple(pages), backup.groups[n].host_pages, num_tokens=140)
                for n in ("full", "sliding")
            }
            result = await (await sched.load(req)).done()
            assert result.groups["full"].moved_device_pages == tuple(pages)
            assert result.groups["sliding"].moved_device_pages == tuple(range(6, 70))
            assert result.groups["sliding"].skipped_device_pages == tuple(range(6))
            partial = {
                n: GroupPages(tuple(pages), g.host_pages, num_tokens=139) for n, g in req.items()
            }
            result = await (await sched.load(partial)).done()
            assert result.groups["sliding"].moved_device_pages[0] == 5  # tokens 11..138
    with stack("qwen3_next_80b.json", move_policy="full_attention_only") as cache:
        async with cache.scheduler.running() as sched:
            backup = await (await sched.backup(pages_for(cache, [1, 2], 1))).done()
            # the engine recomputes linear layers: their state is neither stored nor loaded
            assert backup.groups["linear"].moved_device_pages == ()
            assert backup.groups["linear"].skipped_device_pages == (1,)
            req = {
                "full": GroupPages((1, 2), backup.groups["full"].host_pages),
                "linear": GroupPages((0,), (0,)),
            }
            result = await (await sched.load(req)).done()
            assert result.groups["full"].moved_device_pages == (1, 2)
            assert result.groups["linear"].moved_device_pages == ()
            assert result.groups["linear"].skipped_device_pages == (0,)


@pytest.mark.asyncio
async def test_windowed_load_must_say_its_token_count() -> None:
    """A sliding group's load without num_tokens once assumed whole pages and skipped a page
    still inside the window; now it is refused, and pages given from `first_page` on are
    placed in the prompt by it."""
    with stack("gpt_oss_20b.json", token_pages=80, host_pages=80) as cache:
        async with cache.scheduler.running() as sched:
            pages = list(range(70))
            backup = await (await sched.backup(pages_for(cache, pages, 0))).done()
            hosts = backup.groups["sliding"].host_pages
            with pytest.raises(
                OpRequestError,
                match=r"^group 'sliding' is a sliding-window layer \(window 128\) group: a load must say num_tokens \(the prefix length it serves\), which decides the pages its window needs$",
            ):
                await sched.load({"sliding": GroupPages(tuple(pages), hosts)})
            # 139 tokens need tokens 11..138: pages 5..69; given from page 4 on, one is skipped
            tail = {"sliding": GroupPages(tuple(pages[4:]), hosts[4:], 139, first_page=4)}
            result = await (await sched.load(tail)).done()
            assert result.groups["sliding"].moved_device_pages == tuple(range(5, 70))
            assert result.groups["sliding"].skipped_device_pages == (4,)
        assert_pinned_none(cache)


@pytest.mark.asyncio
async def test_many_concurrent_ops_merge_and_stay_exact() -> None:
    with stack("gpt_oss_20b.json", token_pages=64, host_pages=64, counter_ring_size=2) as cache:
        async with cache.scheduler.running() as sched:
            rng = random.Random(3)
            reqs = [pages_for(cache, rng.sample(range(32), 4), 0) for _ in range(8)]
            wants = [snapshot_pages(cache, r) for r in reqs]
            handles = await asyncio.gather(*(sched.backup(r) for r in reqs))
            results = await asyncio.gather(*(h.done() for h in handles))
            assert all(r.state is OpState.DONE for r in results)
            loads = []
            for k, (req, res) in enumerate(zip(reqs, results, strict=True)):
                dst = list(range(32 + 4 * (k % 8), 36 + 4 * (k % 8)))
                loads.append(
                    {n: GroupPages(tuple(dst), res.groups[n].host_pages, num_tokens=8) for n in req}
                )
            step_a = await sched.load_step(loads[:4])
            step_b = await sched.load_step(loads[4:])
            done = await asyncio.gather(*(h.done() for h in [*step_a, *step_b]))
            assert all(r.state is OpState.DONE for r in done)
            assert sched.stats().merged_walks == 2
            for load, want in zip(loads, wants, strict=True):
                got = snapshot_pages(cache, load)
                assert all(torch.equal(got[k], want[k]) for k in want)
        assert_pinned_none(cache)


@pytest.mark.asyncio
async def test_consumer_released_when_its_layer_lands_not_before() -> None:
    backend = FakeCopyBackend(gated=True)
    with stack("gpt_oss_20b.json", backend=backend) as cache:
        async with cache.scheduler.running() as sched:
            with gate_opened_on_exit(backend):
                backend.open_gate()
                backup = await (await sched.backup(pages_for(cache, [0, 1], 0))).done()
                backend.close_gate()
                req = {
                    n: GroupPages((2, 3), g.host_pages, num_tokens=4)
                    for n, g in backup.groups.items()
                }
                handle = await sched.load(req)
                waiting, released = threading.Event(), threading.Event()

                def consumer() -> None:
                    waiting.set()
                    handle.wait_layer(5)
                    released.set()

                waiter = asyncio.create_task(asyncio.to_thread(consumer))
                # the consumer's thread may start late on a busy machine: its wait (timed from
                # its call) must begin before the 0.1 s below, not somewhere within it
                assert await asyncio.to_thread(waiting.wait, 60)
                backend.release(5)  # layers 0..4 land
                await asyncio.sleep(0.1)  # a duration the wait must cover, not a synchronisation
                assert not released.is_set()
                backend.release(1)  # layer 5 lands
                await asyncio.to_thread(released.wait, 5)
                assert released.is_set()
                backend.open_gate()
                await waiter
                assert (await handle.done()).state is OpState.DONE
                assert sched.stats().layer_wait_s[5] > 0.05


@pytest.mark.asyncio
async def test_failing_layer_fails_op_cleanly_and_later_ops_succeed() -> None:
    backend = FakeCopyBackend()
    with stack("falcon_h1_7b.json", backend=backend) as cache:
        async with cache.scheduler.running() as sched:
            src = pages_for(cache, [1, 2], 1)
            backend.fail_next({3})
            failed = await (await sched.backup(src)).done()
            assert failed.state is OpState.FAILED
            assert "injected fault at layer position 3" in failed.error
            assert set(failed.groups["full"].failed_device_pages) == {1, 2}
            # nothing acknowledged: the backup's host pages went back to the pool
            assert all(
                p.allocator.stats().free_pages == p.num_pages
                for p in cache.host_tier.pools.values()
            )
            ok = await (await sched.backup(src)).done()
            assert ok.state is OpState.DONE
            load = {
                n: GroupPages(
                    g.moved_device_pages,
                    g.host_pages,
                    num_tokens=len(g.moved_device_pages) * PAGE,
                )
                for n, g in ok.groups.items()
            }
            backend.fail_next({0})
            bad_load = await (await sched.load(load)).done()
            assert bad_load.state is OpState.FAILED
            assert (await (await sched.load(load)).done()).state is OpState.DONE
        assert_pinned_none(cache)


@pytest.mark.asyncio
async def test_random_cancellation_points_release_everything() -> None:
    backend = FakeCopyBackend(layer_delay_s=0.0005)
    with stack("jamba_v01.json", backend=backend, host_pages=12, token_pages=16) as cache:
        async with cache.scheduler.running() as sched:
            rng = random.Random(11)
            for _ in range(12):
                handle = await sched.backup(
                    pages_for(cache, rng.sample(range(16), 2), rng.randrange(3))
                )
                await asyncio.sleep(rng.choice([0, 0.001, 0.005, 0.02]))
                handle.cancel()
                result = await handle.done()
                assert result.state in (OpState.CANCELLED, OpState.DONE)
                if result.state is OpState.DONE:
                    for name, out in result.groups.items():
                        cache.host_tier.pool(name).allocator.free(out.host_pages)
            assert all(
                p.allocator.stats().free_pages == p.num_pages
                for p in cache.host_tier.pools.values()
            )
            assert (await (await sched.backup(pages_for(cache, [3], 0))).done()).ok
        assert_pinned_none(cache)


@pytest.mark.asyncio
async def test_deadlines_on_a_fake_clock() -> None:
    clock = FakeClock()
    backend = FakeCopyBackend(gated=True)
    with stack("gpt_oss_20b.json", backend=backend, clock=clock, op_timeout_s=5) as cache:
        async with cache.scheduler.running() as sched:
            with gate_opened_on_exit(backend):
                first = await sched.backup(pages_for(cache, [0], 0))  # runs, held at the gate
                queued = await sched.backup(pages_for(cache, [1], 0), deadline_s=2)
                await asyncio.sleep(0.05)
                assert first.state is OpState.RUNNING
                assert queued.state is OpState.QUEUED
                clock.advance(2.5)
                result = await queued.done()
                assert result.state is OpState.EXPIRED
                assert result.error == "deadline passed while queued"
                clock.advance(3)  # the running op passes its 5 s deadline: the rest is skipped
                backend.open_gate()
                assert (await first.done()).state is OpState.EXPIRED
                assert (await (await sched.backup(pages_for(cache, [2], 0))).done()).ok
        assert_pinned_none(cache)


@pytest.mark.asyncio
async def test_bounded_queue_applies_backpressure() -> None:
    backend = FakeCopyBackend(gated=True)
    with stack("gpt_oss_20b.json", backend=backend, queue_depth=2) as cache:
        async with cache.scheduler.running() as sched:
            with gate_opened_on_exit(backend):
                running = await sched.backup(pages_for(cache, [0], 0))
                await asyncio.sleep(0.05)
                q1 = await sched.backup(pages_for(cache, [1], 0))
                q2 = await sched.backup(pages_for(cache, [2], 0))
                third = asyncio.create_task(sched.backup(pages_for(cache, [3], 0)))
                await asyncio.sleep(0.05)
                assert not third.done()  # the queue is full
                assert sched.stats().queued_backups == 2
                backend.open_gate()
                handles = [running, q1, q2, await third]
                results = await asyncio.gather(*(h.done() for h in handles))
                assert all(r.ok for r in results)


@pytest.mark.asyncio
async def test_guard_errors_and_bad_requests() -> None:
    with stack("nemotron_h_8b.json", start=0, end=26) as cache:
        async with cache.scheduler.running() as sched:
            backup = await (await sched.backup(pages_for(cache, [0], 0))).done()
            req = {
                n: GroupPages(
                    g.moved_device_pages,
                    g.host_pages,
                    num_tokens=len(g.moved_device_pages) * PAGE,
                )
                for n, g in backup.groups.items()
            }
            handle = await sched.load(req)
            with pytest.raises(
                LayerOutsideStageError,
                match=r"^layer 30 of nemotron_h is outside this pipeline stage; this stage holds layers 0\.\.25$",
            ):
                handle.wait_layer(30)
            with pytest.raises(
                UnknownLayerError, match=r"^layer 99 does not exist: nemotron_h has layers 0\.\.51$"
            ):
                handle.wait_layer(99)
            await asyncio.to_thread(handle.wait_layer, 1)  # an MLP-only layer: nothing to wait for
            await handle.done()
            with pytest.raises(
                LayerIdError,
                match=r"^nemotron_h has no cache group 'sliding' in pipeline stage 0\.\.26; groups: \['full', 'mamba'\]$",
            ):
                await sched.load({"sliding": GroupPages((0,), (0,))})
            with pytest.raises(
                OpRequestError,
                match=r"^group 'mamba' is a mamba state group: a load moves exactly one snapshot page of it \(the state at the hit\); got 2$",
            ):
                await sched.load({"mamba": GroupPages((0, 1), (0, 0))})
            with pytest.raises(
                OpRequestError,
                match=r"^group 'full': 2 device pages but 1 host pages; a load pairs them one to one$",
            ):
                await sched.load({"full": GroupPages((0, 1), (0,))})
            with pytest.raises(
                OpRequestError,
                match=r"^group 'full': host page 5 holds nothing \(not allocated in the host pool of 6 pages\)$",
            ):
                await sched.load({"full": GroupPages((0,), (5,))})
            with pytest.raises(
                OpRequestError,
                match=r"^group 'full': num_tokens 9 does not end in the last of the pages given \(prompt pages 0\.\.1 of 2 tokens\); allowed: 3\.\.4$",
            ):
                await sched.load({"full": GroupPages((0, 1), (0, 0), num_tokens=9)})
        assert_pinned_none(cache)
        with pytest.raises(SchedulerClosedError, match=r"^the scheduler is not running"):
            await sched.backup(pages_for(cache, [0], 0))


@pytest.mark.asyncio
async def test_shutdown_finishes_in_flight_and_cancels_queued() -> None:
    backend = FakeCopyBackend(gated=True)
    with stack("gpt_oss_20b.json", backend=backend) as cache:
        async with cache.scheduler.running() as sched:
            with gate_opened_on_exit(backend):
                running = await sched.backup(pages_for(cache, [0], 0))
                queued = await sched.backup(pages_for(cache, [1], 0))
                await asyncio.sleep(0.05)
                closer = asyncio.create_task(sched.shutdown())
                await asyncio.sleep(0.05)
                assert (await queued.done()).state is OpState.CANCELLED
                backend.open_gate()
                report = await closer
        assert report.completed == (running.op_id,)
        assert report.cancelled == (queued.op_id,)
        assert (await running.done()).ok
        assert_pinned_none(cache)


@pytest.mark.asyncio
async def test_pipeline_stage_walks_only_its_layers() -> None:
    with stack("gpt_oss_20b.json", start=12, end=24) as cache:
        assert cache.device_pools["full"].geometry.num_layers == 6
        async with cache.scheduler.running() as sched:
            fence = cache.backend.producer_fence()  # made on the producer's thread
            res = await (await sched.backup(pages_for(cache, [0, 1], 0), fence=fence)).done()
            assert res.ok
            req = {n: GroupPages((4, 5), g.host_pages, num_tokens=4) for n, g in res.groups.items()}
            handle = await sched.load(req)
            await asyncio.to_thread(handle.wait_layer, 23)
            assert (await handle.done()).ok
            assert len(sched.stats().layer_wait_s) == 12
