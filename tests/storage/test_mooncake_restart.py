"""A real mooncake_master killed and started again on the same port under a running tiered
cache (issue #18, 9): engines keep looking up, loading (from L3: L2 is cleared between
rounds) and storing a set of prompts throughout. After the restart the pages the new master
lost are misses — never errors, never wrong bytes (every loaded page is checked) — they leave
the index as L3-present, the engines' stores land again, and the hit rate comes back to what
it was before, within a minute (a liveness bound, not a timing assert). Hit rates and the
mean load time per round are printed for the report (`-s`)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest
import torch

from hicache.assembly import by_key
from hicache.cache import TieredCache
from hicache.memory import GroupGeometry
from hicache.model import LayerMap, load_layout
from hicache.storage import BreakerState, GuardedStore
from hicache.testing.local_servers import MooncakeMaster as MooncakeMasterType
from tests.conftest import shared_model
from tests.storage.prompt_engine import Engine, dense_cache
from tests.storage.servers import MooncakeMaster, started

try:
    import mooncake.store  # noqa: F401

    from hicache.storage.mooncake_backend import MooncakeBackend
except ImportError:  # pragma: no cover - depends on the platform's wheel
    if os.environ.get("CI"):
        raise
    pytest.skip("mooncake-transfer-engine is not installed", allow_module_level=True)

PAGE = 16
PROMPT_PAGES = 6
PROMPTS = [[p * 10_000 + t for t in range(PROMPT_PAGES * PAGE)] for p in range(12)]
RECOVERY_S = 60.0  # liveness: hits must be back well within this
DOWN_S = 3.0  # the master stays down this long, engines still sending


@pytest.fixture
def master() -> Iterator[MooncakeMasterType]:
    with started(MooncakeMaster()) as srv:
        yield srv


def _cache(store: GuardedStore) -> TieredCache:
    return dense_cache(store, PAGE, PROMPT_PAGES)


async def report_round(engine: Engine, label: str) -> tuple[float, float]:
    """One round over PROMPTS (loads from L3, stores again), printed for the report (`-s`):
    (hit rate, mean seconds per load)."""
    rate, spent = await engine.round(PROMPTS)
    store = engine.cache.l3
    assert store is not None
    print(
        f"{label}: hit rate {rate:.2f}, {1e3 * spent:.2f} ms per load, "
        f"breaker {store.breaker.state.value}, L3 pages known "
        f"{engine.cache.index.l3_pages(engine.group)}"
    )
    return rate, spent


@pytest.mark.asyncio
async def test_hits_return_after_the_master_restarts(master: MooncakeMasterType) -> None:
    backend = await asyncio.to_thread(
        MooncakeBackend,
        master.address,
        global_segment_bytes=256 << 20,
        local_buffer_bytes=64 << 20,
    )
    store = GuardedStore(backend, reset_after_s=1.0)
    cache = _cache(store)
    engine = Engine(cache, PAGE, PROMPT_PAGES)
    try:
        async with cache.running():
            for tokens in PROMPTS:
                await engine.store(tokens)
            await cache.persist.idle()
            before, _ = await report_round(engine, "before the restart")
            assert before >= 0.9

            master.stop()
            down_since = time.monotonic()
            while time.monotonic() - down_since < DOWN_S:
                rate, _ = await report_round(engine, "master down")  # misses, no errors
                assert rate == 0.0
                await store.probe()
            assert store.breaker.describe()["state"] != "closed"
            master.start()
            restarted = time.monotonic()

            after = 0.0
            while after < before:
                assert time.monotonic() - restarted < RECOVERY_S, (
                    f"hit rate {after:.2f} {RECOVERY_S}s after the master restarted; "
                    f"{before:.2f} before; store stats {store.stats}"
                )
                await store.probe()  # what the sidecar's probe task does
                after, _ = await report_round(engine, f"{time.monotonic() - restarted:.1f}s after")
                await asyncio.sleep(0.2)
            assert store.breaker.state is BreakerState.CLOSED
            assert cache.background_errors == 0
    finally:
        await backend.close()


@pytest.mark.asyncio
async def test_what_l2_holds_is_back_in_l3_after_the_master_restarts_empty(
    master: MooncakeMasterType,
) -> None:
    """The restarted master has lost every object; the index still marked them as in L3.
    Without a check after the outage, an L2 page "already in L3" is never written again and
    an L2 wipe (or eviction) loses it for good: the hot set stays out of L3 until every
    prefix is recomputed. With it (`hicache/cache/resync.py`), the pages L2 holds are
    persisted again, so loads from L3 hit without a single store."""
    backend = await asyncio.to_thread(
        MooncakeBackend,
        master.address,
        global_segment_bytes=256 << 20,
        local_buffer_bytes=64 << 20,
    )
    store = GuardedStore(backend, reset_after_s=1.0)
    layer_map = LayerMap(load_layout(shared_model("qwen2_7b.json")))
    geoms = [GroupGeometry(g, torch.float16, PAGE) for g in layer_map.groups]
    embedded = by_key.embedded(
        layer_map,
        dtype=torch.float16,
        page_size_tokens=PAGE,
        host_capacity_bytes=len(PROMPTS) * PROMPT_PAGES * sum(g.page_bytes for g in geoms),
        device_pages={g.name: 2 * PROMPT_PAGES for g in geoms},
    )
    cache = by_key.tiered(embedded, store=store, prefetch_policy="wait_complete")
    engine = Engine(cache, PAGE, PROMPT_PAGES)
    try:
        async with cache.running():
            for tokens in PROMPTS:
                await engine.store(tokens)
            await cache.persist.idle()
            master.stop()
            deadline = time.monotonic() + RECOVERY_S
            while store.breaker.state is BreakerState.CLOSED:  # calls fail: it opens
                assert time.monotonic() < deadline, "the breaker never opened"
                await store.exists([b"probe-key-00000"])
            master.start()
            while store.breaker.state is not BreakerState.CLOSED:
                assert time.monotonic() < deadline, f"not back: {store.breaker.describe()}"
                await store.probe()
                await asyncio.sleep(0.2)
            cache.lookup(PROMPTS[0])  # the first op after the outage starts the check
            await cache.drain()
            cache.clear_l2()
            loaded = 0
            for tokens in PROMPTS:  # loads only, no store: L3 must already hold them
                loaded += await engine.load(tokens)
            assert loaded == len(PROMPTS) * PROMPT_PAGES
            resync = cache.resync.stats()
            print(f"resync after the restart: {resync}")
            assert resync.lost == len(PROMPTS) * PROMPT_PAGES  # the new master had none
            assert resync.requeued == resync.lost
            assert cache.background_errors == 0
    finally:
        await backend.close()
