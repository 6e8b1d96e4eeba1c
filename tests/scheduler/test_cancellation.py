"""A caller cancelled (or failing) at any await of `load`, `load_step` or `backup` leaves
nothing behind: the pins and pages admission reserved go back, the op ends CANCELLED and no
walk runs for it later; one whose walk was already submitted is cancelled like any running op
and releases its pins when the walk ends. `OpHandle.done()` after a cancel never hangs.
Fixed points first (a full queue, a load waiting for a counter slot, a walk submitted under
the caller's feet), then random cancellation points (hypothesis)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.embedded import EmbeddedCache
from hicache.scheduler import GroupPages, OpHandle, OpKind, OpState, Scheduler
from hicache.testing.fake_copies import FakeCopyBackend
from hicache.transfer import WalkSignals
from tests.scheduler.conftest import (
    PAGE,
    assert_pinned_none,
    gate_opened_on_exit,
    pages_for,
    stack,
)

MODEL = "gpt_oss_20b.json"  # two token groups (sliding + full): all or nothing across pools
SIZES: dict[str, Any] = {"host_pages": 16, "token_pages": 16}


def free_pages(cache: EmbeddedCache) -> dict[str, int]:
    return {n: p.allocator.stats().free_pages for n, p in cache.host_tier.pools.items()}


def pinned_pages(cache: EmbeddedCache) -> dict[str, int]:
    return {n: p.allocator.stats().pinned_pages for n, p in cache.host_tier.pools.items()}


def load_request(
    stored: Mapping[str, Any], device_pages: Sequence[int], hosts: slice = slice(None)
) -> dict[str, GroupPages]:
    """Load the stored pages `hosts` (of a backup's result groups) into `device_pages`."""
    return {
        name: GroupPages(
            tuple(device_pages), out.host_pages[hosts], num_tokens=len(device_pages) * PAGE
        )
        for name, out in stored.items()
    }


def device_zero(cache: EmbeddedCache, pages: Sequence[int]) -> bool:
    """Whether these device pages hold zeros in every layer of every group."""
    for pool in cache.device_pools.values():
        for local_id in range(pool.geometry.num_layers):
            for tensor, _ in pool.geometry.tensors:
                rows = pool.rows(local_id, tensor)
                if any(int(rows[p].abs().max()) != 0 for p in pages):
                    return False
    return True


def zero_device(cache: EmbeddedCache, pages: Sequence[int]) -> None:
    for pool in cache.device_pools.values():
        for local_id in range(pool.geometry.num_layers):
            for tensor, _ in pool.geometry.tensors:
                rows = pool.rows(local_id, tensor)
                for p in pages:
                    rows[p].zero_()


async def still_works(cache: EmbeddedCache, sched: Scheduler) -> None:
    """A backup and a load of it both succeed, and their pages go back afterwards."""
    before = free_pages(cache)
    stored = await (await sched.backup(pages_for(cache, [6, 7], 0))).done()
    assert stored.ok, stored.error
    loaded = await (await sched.load(load_request(stored.groups, [8, 9]))).done()
    assert loaded.ok, loaded.error
    for name, out in stored.groups.items():
        cache.host_tier.pool(name).allocator.free(out.host_pages)
    assert free_pages(cache) == before


Call = Literal["load", "load_step", "backup"]


async def call(sched: Scheduler, what: Call, cache: EmbeddedCache, req: Any) -> list[OpHandle]:
    if what == "load":
        return [await sched.load(req)]
    if what == "load_step":
        return await sched.load_step([req, req])
    return [await sched.backup(pages_for(cache, [5], 0))]


@pytest.mark.asyncio
@pytest.mark.parametrize("what", ["load", "load_step", "backup"])
async def test_caller_cancelled_waiting_for_queue_space_releases_what_it_reserved(
    what: Call,
) -> None:
    """The queue is full (depth 1, one backup held at the gate, one queued): the caller's ops
    are admitted — pinned or allocated — and wait for space; a timeout cancels the caller
    there. Before, their pins and pages stayed taken for good."""
    backend = FakeCopyBackend(gated=True)
    with stack(MODEL, backend=backend, queue_depth=1, **SIZES) as cache:
        async with cache.scheduler.running() as sched:
            with gate_opened_on_exit(backend):
                backend.open_gate()
                stored = await (await sched.backup(pages_for(cache, [0, 1], 0))).done()
                backend.close_gate()
                running = await sched.backup(pages_for(cache, [2], 0))
                await asyncio.sleep(0.05)
                assert running.state is OpState.RUNNING  # held at the gate
                queued = await sched.backup(pages_for(cache, [3], 0))  # the queue is full
                pins, free = pinned_pages(cache), free_pages(cache)
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await call(sched, what, cache, load_request(stored.groups, [4, 5]))
                assert pinned_pages(cache) == pins, "the cancelled caller's pins leaked"
                assert free_pages(cache) == free, "the cancelled caller's pages leaked"
                assert sched.stats().queued_loads + sched.stats().queued_backups == 1
                backend.open_gate()
                for handle in (running, queued):
                    result = await handle.done()
                    assert result.ok, result.error
                    for name, out in result.groups.items():
                        cache.host_tier.pool(name).allocator.free(out.host_pages)
                cancelled = 2 if what == "load_step" else 1
                assert sched.stats().ops_by_state == {"done": 3, "cancelled": cancelled}
                await still_works(cache, sched)
        assert_pinned_none(cache)


class HookedBackend(FakeCopyBackend):
    """Calls `after_submit()` on the loop right after a walk is handed over, before the
    scheduler marks it submitted: a caller cancelled there has a walk in flight."""

    after_submit: Callable[[], None] | None = None

    def submit_walk(self, *args: Any, **kwargs: Any) -> WalkSignals:
        signals = super().submit_walk(*args, **kwargs)
        hook, self.after_submit = self.after_submit, None
        if hook is not None:
            hook()
        return signals


@pytest.mark.asyncio
async def test_load_step_cancelled_while_its_walk_waits_for_a_slot_never_runs() -> None:
    """One counter slot, held by a load at the gate; a second `load_step` is queued and its
    caller cancelled. Before, the queued load stayed queued and ran later, writing device pages
    the cancelled caller no longer expected to change."""
    backend = FakeCopyBackend(gated=True)
    with stack(MODEL, backend=backend, counter_ring_size=1, **SIZES) as cache:
        async with cache.scheduler.running() as sched:
            with gate_opened_on_exit(backend):
                backend.open_gate()
                stored = await (await sched.backup(pages_for(cache, [0, 1, 2, 3], 0))).done()
                backend.close_gate()
                zero_device(cache, [4, 5, 6, 7])
                first = await sched.load(load_request(stored.groups, [4, 5], slice(0, 2)))
                second = asyncio.create_task(
                    sched.load_step([load_request(stored.groups, [6, 7], slice(2, 4))])
                )
                await asyncio.sleep(0.05)
                assert not second.done()  # waits for the one counter slot
                assert sched.stats().queued_loads == 1
                second.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await second
                assert sched.stats().queued_loads == 0
                backend.open_gate()
                assert (await first.done()).ok
                await asyncio.sleep(0.05)
                assert device_zero(cache, [6, 7]), "the cancelled load ran anyway"
                assert not device_zero(cache, [4, 5])
                assert sched.stats().ops_by_state == {"done": 2, "cancelled": 1}
                await still_works(cache, sched)
        assert_pinned_none(cache)


@pytest.mark.asyncio
async def test_caller_cancelled_after_its_walk_was_submitted_cancels_the_walk() -> None:
    """The dispatcher submits the queued load's walk and, in the same step, the caller is
    cancelled (it never gets the handle): the walk is cancelled through the normal path — its
    layers held at the gate are skipped, its pins go when the walk ends."""
    backend = HookedBackend(gated=True)
    with stack(MODEL, backend=backend, counter_ring_size=1, **SIZES) as cache:
        async with cache.scheduler.running() as sched:
            with gate_opened_on_exit(backend):
                backend.open_gate()
                stored = await (await sched.backup(pages_for(cache, [0, 1, 2, 3], 0))).done()
                backend.close_gate()
                zero_device(cache, [4, 5, 6, 7])
                first = await sched.load(load_request(stored.groups, [4, 5], slice(0, 2)))
                second = asyncio.create_task(
                    sched.load(load_request(stored.groups, [6, 7], slice(2, 4)))
                )
                await asyncio.sleep(0.05)
                backend.after_submit = second.cancel
                # the first load's layers pass the gate; the second's walk is submitted and
                # waits at the gate for its first layer while the caller is cancelled
                backend.release(len(sched.layer_map.stage_layer_ids))
                with pytest.raises(asyncio.CancelledError):
                    await second
                assert (await first.done()).ok
                backend.open_gate()
                for _ in range(100):
                    if sched.stats().in_flight_walks == 0:
                        break
                    await asyncio.sleep(0.01)
                assert sched.stats().ops_by_state == {"done": 2, "cancelled": 1}
                assert backend.after_submit is None  # the hook did run
                assert device_zero(cache, [6, 7]), "the cancelled walk copied its layers"
                await still_works(cache, sched)
        assert_pinned_none(cache)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "point", ["queued", "at_gate", "mid_walk", "ended", "other_thread", "one_of_a_step"]
)
async def test_done_after_cancel_never_hangs(point: str) -> None:
    """`handle.cancel()` at any point of an op's life, then `await handle.done()`: it returns
    a final state (within seconds; the gate is open)."""
    backend = FakeCopyBackend(gated=True)
    with stack(MODEL, backend=backend, counter_ring_size=1, **SIZES) as cache:
        async with cache.scheduler.running() as sched:
            with gate_opened_on_exit(backend):
                backend.open_gate()
                stored = await (await sched.backup(pages_for(cache, [0, 1, 2, 3], 0))).done()
                req = load_request(stored.groups, [4, 5], slice(0, 2))
                if point == "ended":
                    handles = [await sched.load(req)]
                    await handles[0].done()
                else:
                    backend.close_gate()
                    blocker = await sched.load(req)
                    handles = [blocker]
                    if point == "queued":  # the returned handle waits for nothing: the
                        # blocker's walk is submitted; a backup queues behind the gate
                        await sched.backup(pages_for(cache, [6], 0))
                        handles.append(await sched.backup(pages_for(cache, [7], 0)))
                        assert handles[-1].state is OpState.QUEUED
                    elif point == "mid_walk":
                        backend.release(3)
                        await asyncio.sleep(0.05)
                    elif point == "one_of_a_step":
                        backend.open_gate()
                        await blocker.done()
                        backend.close_gate()
                        handles = await sched.load_step([req, req])
                        handles = handles[:1]  # the other op of the walk is not cancelled
                    assert all(h.state is not OpState.QUEUED for h in handles[:1])
                target = handles[-1]
                if point == "other_thread":
                    thread = threading.Thread(target=target.cancel)
                    thread.start()
                    thread.join()
                else:
                    target.cancel()
                backend.open_gate()
                result = await asyncio.wait_for(target.done(), 5)
                assert result.state.final
                for handle in handles:
                    assert (await asyncio.wait_for(handle.done(), 5)).state.final
                await still_works(cache, sched)
        assert_pinned_none(cache)


# ---- random cancellation points (hypothesis) ------------------------------------------------

_kinds = st.sampled_from(["load", "load_step", "backup"])
_how = st.sampled_from(["caller", "handle", "none"])  # cancel the caller's task, or the handle
_step = st.tuples(_kinds, _how, st.integers(0, 40), st.sampled_from([0.0, 0.0005, 0.003]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.lists(_step, min_size=1, max_size=10))
def test_cancelling_at_random_points_leaks_nothing(
    plan: list[tuple[Call, str, int, float]],
) -> None:
    asyncio.run(_cancel_at_random(plan))


async def _cancel_at_random(plan: list[tuple[Call, str, int, float]]) -> None:
    backend = FakeCopyBackend(layer_delay_s=0.0002)
    with stack(
        MODEL, backend=backend, queue_depth=2, counter_ring_size=1, host_pages=48, token_pages=16
    ) as cache:
        async with cache.scheduler.running() as sched:
            stored = await (await sched.backup(pages_for(cache, [0, 1, 2, 3], 0))).done()
            assert stored.ok
            base = free_pages(cache)
            req = load_request(stored.groups, [4, 5, 6, 7])
            tasks = [asyncio.create_task(call(sched, what, cache, req)) for what, _, _, _ in plan]
            for task, (_, how, yields, delay) in zip(tasks, plan, strict=True):
                for _ in range(yields):
                    await asyncio.sleep(0)
                if delay:
                    await asyncio.sleep(delay)
                if how == "caller":
                    task.cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            for outcome, (_, how, _, _) in zip(outcomes, plan, strict=True):
                if isinstance(outcome, BaseException):
                    assert isinstance(outcome, asyncio.CancelledError), outcome
                    continue
                for handle in outcome:
                    assert handle.state is not OpState.QUEUED or handle.kind is OpKind.BACKUP
                    if how == "handle":
                        handle.cancel()
                    result = await asyncio.wait_for(handle.done(), 10)
                    assert result.state.final
                    if result.ok and result.kind is OpKind.BACKUP:
                        for name, out in result.groups.items():
                            cache.host_tier.pool(name).allocator.free(out.host_pages)
            for _ in range(200):  # walks of cancelled callers end on the backend's thread
                if sched.stats().in_flight_walks == 0:
                    break
                await asyncio.sleep(0.01)
            stats = sched.stats()
            assert (stats.queued_loads, stats.queued_backups, stats.in_flight_walks) == (0, 0, 0)
            assert stats.in_flight_bytes == 0
            assert set(stats.ops_by_state) <= {"done", "cancelled"}, stats.ops_by_state
            assert pinned_pages(cache) == dict.fromkeys(base, 0)
            assert free_pages(cache) == base
            for pool in cache.host_tier.pools.values():
                pool.allocator.check()
            await still_works(cache, sched)
        assert_pinned_none(cache)
