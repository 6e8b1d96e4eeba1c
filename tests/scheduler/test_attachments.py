"""Ops against the device pools of the attachment that issued them (many engines, one
scheduler): a load copies into its own attachment's pools only, a backup reads its own; ending
one attachment cancels and awaits only its ops; refusals name the attachment."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

from hicache.embedded import EmbeddedCache
from hicache.memory import DevicePool
from hicache.scheduler import DEFAULT_ATTACHMENT, GroupPages, OpRequestError, OpState
from hicache.testing.fake_copies import FakeCopyBackend
from tests.scheduler.conftest import PAGE, assert_pinned_none, gate_opened_on_exit, stack

MODEL = "gpt_oss_20b.json"  # sliding + full: two groups


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(30_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the condition never held")


def other_pools(cache: EmbeddedCache, pages: int, fill: int) -> dict[str, DevicePool]:
    """Another engine's pools for the stage, every byte `fill`."""
    pools = {}
    for name, geom in cache.geometries.items():
        pool = DevicePool.allocate(geom, pages, cache.backend.device)
        for layer in pool.tensors:
            for t in layer.values():
                t.view(torch.uint8).fill_(fill)
        pools[name] = pool
    return pools


def rows(pool: DevicePool, page: int) -> list[torch.Tensor]:
    return [
        pool.rows(local, tensor)[page].clone()
        for local in range(pool.geometry.num_layers)
        for tensor, _ in pool.geometry.tensors
    ]


def request(
    cache: EmbeddedCache, pages: list[int], hosts: dict[str, tuple[int, ...]] | None = None
):  # type: ignore[no-untyped-def]
    out = {}
    for name in cache.geometries:
        if hosts is None:
            out[name] = GroupPages(tuple(pages))
        else:
            out[name] = GroupPages(tuple(pages), hosts[name], num_tokens=len(pages) * PAGE)
    return out


@pytest.mark.asyncio
async def test_each_attachments_ops_move_its_own_pools() -> None:
    with stack(MODEL) as cache:
        b_pools = other_pools(cache, 8, 0xAB)
        a_pools = cache.device_pools
        async with cache.scheduler.running() as sched:
            sched.attach_device_pools(b_pools, attachment=7)
            assert sched.attachments == (DEFAULT_ATTACHMENT, 7)
            # a backup from B's pools holds B's bytes, not the default attachment's
            backup = await (await sched.backup(request(cache, [1, 2]), attachment=7)).done()
            assert backup.state is OpState.DONE, backup.error
            hosts = {n: g.host_pages for n, g in backup.groups.items()}
            a_before = {n: rows(p, 5) for n, p in a_pools.items()}
            b_before = {n: rows(p, 5) for n, p in b_pools.items()}
            # loaded into the default attachment's page 5: B's bytes land there, B unchanged
            load = request(cache, [5, 6], hosts)
            result = await (await sched.load(load)).done()
            assert result.state is OpState.DONE, result.error
            for name, pool in a_pools.items():
                assert all(int(r.view(torch.uint8).min()) == 0xAB for r in rows(pool, 5)), name
                assert any(
                    not torch.equal(x, y)
                    for x, y in zip(rows(pool, 5), a_before[name], strict=True)
                )
            for name, pool in b_pools.items():
                assert all(
                    torch.equal(x, y) for x, y in zip(rows(pool, 5), b_before[name], strict=True)
                ), name
            # and the default attachment's bytes loaded into B's page 0
            src = {n: rows(p, 3) for n, p in a_pools.items()}
            own = await (await sched.backup(request(cache, [3]))).done()
            hosts = {n: g.host_pages for n, g in own.groups.items()}
            done = await (await sched.load(request(cache, [0], hosts), attachment=7)).done()
            assert done.state is OpState.DONE, done.error
            for name, pool in b_pools.items():
                assert all(
                    torch.equal(x, y) for x, y in zip(rows(pool, 0), src[name], strict=True)
                ), name
        assert_pinned_none(cache)


@pytest.mark.asyncio
async def test_ending_one_attachment_cancels_only_its_ops() -> None:
    backend = FakeCopyBackend(gated=True)
    with stack(MODEL, backend=backend, host_pages=12) as cache, gate_opened_on_exit(backend):
        async with cache.scheduler.running() as sched:
            sched.attach_device_pools(other_pools(cache, 8, 1), attachment=1)
            sched.attach_device_pools(other_pools(cache, 8, 2), attachment=2)
            b_up = await sched.backup(request(cache, [0, 1]), attachment=2)
            a_up = await sched.backup(request(cache, [0, 1]), attachment=1)
            assert sched.live_ops(1) == 1
            assert sched.live_ops(2) == 1
            with pytest.raises(
                OpRequestError,
                match=r"^device pools of attachment 1 can be dropped only while none of its ops "
                r"is queued or in flight; 0 in flight, 1 queued$",
            ):
                sched.detach_device_pools(1)
            ending = asyncio.ensure_future(sched.end_attachment(1))
            backend.open_gate()
            assert await ending == 1
            a_result = await a_up.done()
            b_result = await b_up.done()
            assert a_result.state is OpState.CANCELLED
            assert b_result.state is OpState.DONE, b_result.error
            assert sched.attachments == (DEFAULT_ATTACHMENT, 2)
            with pytest.raises(
                OpRequestError,
                match=r"^attachment 1: no device pools are attached under it \(its engine "
                r"detached, or never attached\); attached: \[0, 2\]$",
            ):
                await sched.backup(request(cache, [0]), attachment=1)
            # the other attachment goes on
            again = await (await sched.backup(request(cache, [2]), attachment=2)).done()
            assert again.state is OpState.DONE, again.error
            for result in (b_result, again):
                for name, group in result.groups.items():
                    cache.host_tier.pool(name).allocator.free(list(group.host_pages))
        assert_pinned_none(cache)


@pytest.mark.asyncio
async def test_ending_an_attachment_mid_walk_waits_for_its_copies() -> None:
    """A running walk of the ending attachment is cancelled and awaited: its pins go before
    `end_attachment` returns, so its pools are never dropped under a copy."""
    backend = FakeCopyBackend(gated=True)
    with stack(MODEL, backend=backend) as cache, gate_opened_on_exit(backend):
        async with cache.scheduler.running() as sched:
            sched.attach_device_pools(other_pools(cache, 8, 3), attachment=4)
            handle = await sched.backup(request(cache, [0, 1]), attachment=4)
            backend.release(1)  # the walk starts: one layer copies, the next waits
            await until(lambda: sched.stats().in_flight_walks > 0)
            ending = asyncio.ensure_future(sched.end_attachment(4))
            await asyncio.sleep(0)
            assert not ending.done()  # the walk still holds the pools
            backend.open_gate()
            assert await ending == 1
            assert (await handle.done()).state is OpState.CANCELLED
            assert sched.attachments == (DEFAULT_ATTACHMENT,)
        assert_pinned_none(cache)


@pytest.mark.asyncio
async def test_an_op_waiting_for_queue_space_ends_with_its_attachment() -> None:
    backend = FakeCopyBackend(gated=True)
    with (
        stack(MODEL, backend=backend, host_pages=12, queue_depth=1) as cache,
        gate_opened_on_exit(backend),
    ):
        async with cache.scheduler.running() as sched:
            sched.attach_device_pools(other_pools(cache, 8, 5), attachment=9)
            first = await sched.backup(request(cache, [0]))  # the queue's one place
            blocked = asyncio.ensure_future(sched.backup(request(cache, [1]), attachment=9))
            await until(lambda: sched.live_ops(9) > 0)
            assert await sched.end_attachment(9) == 1
            handle = await blocked
            assert (await handle.done()).state is OpState.CANCELLED
            backend.open_gate()
            result = await first.done()
            assert result.state is OpState.DONE, result.error
            for name, group in result.groups.items():
                cache.host_tier.pool(name).allocator.free(list(group.host_pages))
            await sched.idle()  # nothing counted as queued is left behind
        assert_pinned_none(cache)


@pytest.mark.asyncio
async def test_attaching_checks_groups_and_geometry() -> None:
    with stack(MODEL) as cache, stack("qwen2_7b.json") as other:
        sched = cache.scheduler
        with pytest.raises(
            OpRequestError,
            match=r"^device pools \['full'\] given; the stage's groups are \['full', 'sliding'\]$",
        ):
            sched.attach_device_pools({"full": cache.device_pools["full"]}, attachment=3)
        wrong = {"full": other.device_pools["full"], "sliding": cache.device_pools["sliding"]}
        with pytest.raises(
            OpRequestError, match=r"^group 'full': the device pool's geometry .* differs from"
        ):
            sched.attach_device_pools(wrong, attachment=3)
        assert sched.attachments == (DEFAULT_ATTACHMENT,)
