"""Two engines (scheduler attachments) over one tiered cache: stores and loads move each
engine's own device pools; concurrent stores of one prefix store it once, and a store that
left pages to another engine's store in flight is acknowledged only once L2 holds them — or
stores them itself when that store failed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
import torch

from hicache.assembly import by_key
from hicache.cache import TieredCache
from hicache.memory import DevicePool
from hicache.model import LayerMap, load_layout
from hicache.testing.fake_copies import FakeCopyBackend
from tests.cache.test_core import assert_consistent
from tests.conftest import shared_model

PAGE = 4
A, B = 1, 2  # attachment ids, as the sidecar's session ids


@contextmanager
def shared_cache(backend: FakeCopyBackend) -> Iterator[TieredCache]:
    layer_map = LayerMap(load_layout(shared_model("qwen2_7b.json")))
    embedded = by_key.embedded(
        layer_map,
        dtype=torch.float16,
        page_size_tokens=PAGE,
        host_capacity_bytes=1 << 22,
        host_pages_per_group={"full": 16},
        device_pages=16,
        backend=backend,
    )
    try:
        yield by_key.tiered(embedded)
    finally:
        backend.open_gate()
        embedded.close()


def engine_pools(cache: TieredCache, fill: int) -> dict[str, DevicePool]:
    pools = {}
    for name, geom in cache.embedded.geometries.items():
        pool = DevicePool.allocate(geom, 16, cache.embedded.backend.device)
        for layer in pool.tensors:
            for t in layer.values():
                t.view(torch.uint8).fill_(fill)
        pools[name] = pool
    return pools


def page_bytes(pool: DevicePool, page: int) -> set[int]:
    """The distinct byte values of one device page across its layers."""
    values: set[int] = set()
    for local in range(pool.geometry.num_layers):
        for tensor, _ in pool.geometry.tensors:
            values |= set(pool.rows(local, tensor)[page].view(torch.uint8).unique().tolist())
    return values


@asynccontextmanager
async def two_engines(
    cache: TieredCache,
) -> AsyncIterator[tuple[dict[str, DevicePool], dict[str, DevicePool]]]:
    async with cache.running():
        a, b = engine_pools(cache, 0x11), engine_pools(cache, 0x22)
        cache.embedded.scheduler.attach_device_pools(a, attachment=A)
        cache.embedded.scheduler.attach_device_pools(b, attachment=B)
        try:
            yield a, b
        finally:  # a failed assertion must not leave a walk at the gate: the exit awaits it
            backend = cache.embedded.backend
            assert isinstance(backend, FakeCopyBackend)
            backend.open_gate()


async def until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(30_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never saw {what}")


async def yielded(times: int = 20) -> None:
    for _ in range(times):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_loads_and_stores_move_the_issuing_engines_pools() -> None:
    with shared_cache(FakeCopyBackend()) as cache:
        async with two_engines(cache) as (a, b):
            tokens = list(range(3 * PAGE))
            stored = await cache.store(tokens, {"full": [0, 1, 2]}, attachment=B)
            assert stored.pages_stored == 3
            handle, hit = await cache.load(tokens, {"full": [5, 6, 7]}, attachment=A)
            assert handle is not None
            assert hit.tokens_total == 3 * PAGE
            assert (await handle.done()).ok
            for page in (5, 6, 7):
                assert page_bytes(a["full"], page) == {0x22}  # B's bytes, in A's pool
                assert page_bytes(b["full"], page) == {0x22}  # B's pool untouched
            await cache.drain()
            assert_consistent(cache)


@pytest.mark.asyncio
async def test_a_store_meeting_another_engines_store_of_its_prefix_waits_for_it() -> None:
    backend = FakeCopyBackend(gated=True)
    with shared_cache(backend) as cache:
        async with two_engines(cache) as (a, _b):
            tokens = list(range(4 * PAGE))
            first = asyncio.ensure_future(cache.store(tokens, {"full": [0, 1, 2, 3]}, attachment=A))
            await until(lambda: cache.planner.pending["full"], "A's plan")
            second = asyncio.ensure_future(
                cache.store(tokens, {"full": [4, 5, 6, 7]}, attachment=B)
            )
            await yielded()
            # B left all four pages to A's backup, held at the gate: not acknowledged yet
            assert not second.done()
            assert cache.lookup(tokens).tokens_l2 == 0
            backend.open_gate()
            got = await second
            assert cache.lookup(tokens).tokens_l2 == 4 * PAGE  # acked: L2 holds them
            assert (await first).pages_stored == 4
            assert got.pages_stored == 0  # stored once, by A
            handle, _ = await cache.load(tokens, {"full": [8, 9, 10, 11]}, attachment=A)
            assert handle is not None
            assert (await handle.done()).ok
            assert all(page_bytes(a["full"], p) == {0x11} for p in (8, 9, 10, 11))
            await cache.drain()
            assert_consistent(cache)


@pytest.mark.asyncio
async def test_pages_left_to_a_store_that_failed_are_stored_by_the_waiting_one() -> None:
    """A's backup fails (its engine died under it, or a copy failed): B, which left those
    pages to it, stores them from its own pools before it is acknowledged. Before, B was
    acknowledged at once with the pages stored by no one."""
    backend = FakeCopyBackend(gated=True)
    with shared_cache(backend) as cache:
        async with two_engines(cache) as (a, _b):
            tokens = list(range(4 * PAGE))
            backend.fail_next({0})  # the first walk fails at its first layer: A's
            first = asyncio.ensure_future(cache.store(tokens, {"full": [0, 1, 2, 3]}, attachment=A))
            await until(lambda: cache.planner.pending["full"], "A's plan")
            # B's prompt extends A's: it stores its own fifth page and waits for the rest
            longer = list(range(5 * PAGE))
            second = asyncio.ensure_future(
                cache.store(longer, {"full": [4, 5, 6, 7, 8]}, attachment=B)
            )
            await yielded()
            assert not second.done()
            backend.open_gate()
            assert (await first).pages_stored == 0
            got = await second
            assert got.pages_stored == 5  # its own fifth page, then A's four again
            assert cache.lookup(longer).tokens_l2 == 5 * PAGE
            handle, _ = await cache.load(longer, {"full": [9, 10, 11, 12, 13]}, attachment=A)
            assert handle is not None
            assert (await handle.done()).ok
            assert all(page_bytes(a["full"], p) == {0x22} for p in (9, 10, 11, 12, 13))
            await cache.drain()
            assert_consistent(cache)


@pytest.mark.asyncio
async def test_concurrent_stores_of_overlapping_prompts_from_two_engines() -> None:
    """Both engines store and load overlapping prompts at once, many times: every page is
    stored once per key, each load lands the stored bytes in the loader's pool only, and
    nothing stays pinned, pending or allocated."""
    with shared_cache(FakeCopyBackend()) as cache:
        async with two_engines(cache) as (a, b):
            pools = {A: a, B: b}
            fill = {A: 0x11, B: 0x22}

            async def engine(me: int, rounds: int) -> int:
                stored = 0
                for r in range(rounds):
                    tokens = list(range((2 + r % 3) * PAGE))  # 2..4 pages of one prefix
                    n = len(tokens) // PAGE
                    result = await cache.store(tokens, {"full": list(range(n))}, attachment=me)
                    stored += result.pages_stored
                    # A loads into pages 8.., B into 12..: in the other's pool those pages
                    # are never written, so they keep their owner's fill
                    dst = list(range(8 if me == A else 12, (8 if me == A else 12) + n))
                    handle, hit = await cache.load(tokens, {"full": dst}, attachment=me)
                    assert handle is not None
                    assert hit.tokens_total == len(tokens)
                    assert (await handle.done()).ok
                    for page in dst:
                        assert len(page_bytes(pools[me]["full"], page)) == 1  # one store's
                    other = B if me == A else A
                    for page in dst:
                        assert page_bytes(pools[other]["full"], page) == {fill[other]}
                return stored

            totals = await asyncio.gather(engine(A, 12), engine(B, 12))
            assert sum(totals) == 4  # four distinct pages, each stored once
            await cache.drain()
            assert_consistent(cache)
