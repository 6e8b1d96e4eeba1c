"""The `timeout` prefetch policy's deadline (issue #18): the old fixed one (2 ms + 2 us per
token) lost to any L3 read slower than that, so under load it served almost nothing. The
default now follows L3's measured read rate (`cache.prefetch_timeout_s: auto`): the hit's
L3-only bytes at that rate, times a headroom, plus a floor, at most a cap.

No test here asserts a duration: the policy's arithmetic is checked as numbers, the rate
from given samples, and the cache by outcome — a read far slower than the fixed deadline
(100 ms) is missed by it and served by the auto one measured on the same L3; a read that
never returns is left behind (the load returns while it still waits at its gate)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from hicache.cache import TieredCache
from hicache.cache.read_rate import ReadRate
from hicache.config.schema import CacheSection
from hicache.index import Hit
from hicache.index.policies import AUTO_START_BYTES_PER_S, PREFETCH_POLICIES, Timeout
from hicache.scheduler import OpHandle
from hicache.storage import FileBackend, GuardedStore
from hicache.testing.faulty_storage import FaultyBackend
from tests.cache.test_core import assert_consistent
from tests.cache.test_l3_swap import Gates, parked
from tests.test_tiered import PAGE, build

SLOW_READ_S = 0.1  # every L3 read takes at least this: 50x the old fixed deadline


def test_a_fixed_deadline_is_what_it_always_was() -> None:
    fixed = PREFETCH_POLICIES["timeout"]()
    assert fixed.wait_s(1000) == pytest.approx(0.002 + 2e-6 * 1000)
    assert fixed.wait_s(1000, l3_bytes=1 << 30, read_bytes_per_s=1.0) == fixed.wait_s(1000)


def test_an_auto_deadline_follows_the_read_rate_between_its_floor_and_cap() -> None:
    auto = Timeout(base_s="auto", headroom=2.0, floor_s=0.01, max_s=1.0)
    # 10 MB at 100 MB/s: 0.1 s expected, 0.2 s with headroom, plus the floor
    assert auto.wait_s(64, 10_000_000, 100e6) == pytest.approx(0.21)
    assert auto.wait_s(64, 10_000_000, 200e6) == pytest.approx(0.11)  # faster L3: sooner
    # before any measurement: the slowest rate the guarded store tolerates
    assert auto.wait_s(64, 10_000_000, None) == pytest.approx(0.01 + 2 * 10e6 / 50e6)
    assert AUTO_START_BYTES_PER_S == 50e6
    assert auto.wait_s(64, 0, 100e6) == pytest.approx(0.01)  # nothing to read: the floor
    assert auto.wait_s(64, 10_000_000_000, 100e6) == 1.0  # a crawling L3: the cap


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"base_s": -1.0},
            r"^timeout prefetch policy: base_s=-1.0; must be a number >= 0.0 or 'auto'$",
        ),
        ({"headroom": 0}, r"^timeout prefetch policy: headroom=0; must be a number > 0.0$"),
        (
            {"max_s": float("inf")},
            r"^timeout prefetch policy: max_s=inf; must be a number > 0.0$",
        ),
        (
            {"floor_s": 2.0, "max_s": 1.0},
            r"^timeout prefetch policy: floor_s=2.0 is above max_s=1.0; the floor must be "
            r"<= the cap$",
        ),
    ],
)
def test_a_bad_timeout_policy_is_refused_by_name(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Timeout(**kwargs)


def test_the_cache_section_takes_auto_or_seconds() -> None:
    assert CacheSection().prefetch_timeout_s == "auto"
    assert CacheSection(prefetch_timeout_s=0.05).prefetch_timeout_s == 0.05
    with pytest.raises(ValidationError, match="prefetch_timeout_s"):
        CacheSection(prefetch_timeout_s="soon")
    with pytest.raises(ValidationError, match="prefetch_timeout_s"):
        CacheSection(prefetch_timeout_s=-0.1)
    with pytest.raises(
        ValidationError,
        match=r"prefetch_auto_floor_s 2\.0 is above prefetch_timeout_max_s 1\.0; the floor "
        r"must be <= the cap",
    ):
        CacheSection(prefetch_auto_floor_s=2.0)


def test_the_read_rate_weighs_bytes_and_seconds_and_ignores_empty_reads() -> None:
    rate = ReadRate(weight=0.5)
    assert rate.bytes_per_s() is None
    rate.observe(1000, 1.0)
    assert rate.bytes_per_s() == pytest.approx(1000.0)
    rate.observe(0, 30.0)  # nothing verified (L3 down, all absent): no sample
    assert rate.bytes_per_s() == pytest.approx(1000.0)
    rate.observe(3000, 1.0)  # averages 2000 bytes over 1 s
    assert rate.bytes_per_s() == pytest.approx(2000.0)
    assert rate.samples == 2
    rate.reset()
    assert rate.bytes_per_s() is None
    with pytest.raises(ValueError, match=r"^ReadRate weight=0: must be a number in \(0, 1\]$"):
        ReadRate(weight=0)


async def only_in_l3(cache, tokens: list[int], first_page: int) -> None:  # type: ignore[no-untyped-def]
    """Store the prompt, let it reach L3, and drop it from L2."""
    pages = list(range(first_page, first_page + len(tokens) // PAGE))
    await cache.store(tokens, {"full": pages})
    await cache.drain()
    cache.clear_l2()
    assert cache.lookup(tokens).tokens_l2 == 0


@pytest.mark.asyncio
@pytest.mark.parametrize(("deadline", "served"), [(0.002, False), ("auto", True)])
async def test_a_slow_l3_read_is_served_by_the_auto_deadline_not_the_fixed_one(
    tmp_path: Path, deadline: float | str, served: bool
) -> None:
    """The same L3, each read at least SLOW_READ_S: the old fixed deadline gives up on it
    (recompute), the auto one — sized by the read measured before — waits for it."""
    cache, faulty = build(
        tmp_path,
        "qwen2_7b.json",
        host_pages=16,
        prefetch_policy="timeout",
        prefetch_timeout_s=deadline,
        # generous: the second read may be scheduled late on a loaded machine; the fixed
        # deadline (2 ms) still cannot wait out a read of SLOW_READ_S
        prefetch_auto_headroom=20.0,
        prefetch_timeout_max_s=30.0,
    )
    try:
        async with cache.running():
            warm, cold = list(range(4 * PAGE)), list(range(100, 100 + 4 * PAGE))
            await only_in_l3(cache, warm, 0)
            await only_in_l3(cache, cold, 4)
            faulty.latency_s = SLOW_READ_S
            assert await cache.prefetch(warm) == 4  # one read of 4 pages, measured
            assert cache.io.read_rate.samples == 1
            handle, hit = await cache.load(cold, {"full": [8, 9, 10, 11]})
            if served:
                assert (hit.tokens_total, hit.failed) == (4 * PAGE, {})
                assert handle is not None
                assert (await handle.done()).ok
            else:
                assert hit.failed == {"full": (0, 1, 2, 3)}
                assert handle is None
            await cache.drain()  # a missed read still lands in L2, for the next request
            assert cache.lookup(cold).tokens_l2 == 4 * PAGE
            assert_consistent(cache)
    finally:
        cache.embedded.close()


def gated(tmp_path: Path, **build_args: Any) -> tuple[TieredCache, Gates]:
    """A cache whose L3 reads wait at a gate the test opens (`Gates`)."""
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=16, **build_args)
    gates = Gates(tmp_path / "gated")
    cache.attach_l3(GuardedStore(gates, base_timeout_s=60.0))
    return cache, gates


async def a_hanging_read_is_left_behind(
    cache: TieredCache,
    gates: Gates,
    load: Callable[[list[int]], Awaitable[tuple[OpHandle | None, Hit]]],
) -> None:
    """A prompt only in L3 whose read is held at the gate: `load(tokens)` returns every page
    failed while the read still waits; the read's pages are freed once it ends."""
    try:
        async with cache.running():
            tokens = list(range(4 * PAGE))
            await only_in_l3(cache, tokens, 0)
            gates.read_gate.clear()
            handle, hit = await load(tokens)
            assert (handle, hit.failed) == (None, {"full": (0, 1, 2, 3)})
            await parked(gates)  # the read still waits: the load did not
            gates.read_gate.set()
            await cache.drain()
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_a_hanging_l3_costs_a_load_at_most_the_cap(tmp_path: Path) -> None:
    """A read that never returns: the auto deadline is capped, so the load returns — the
    read still parked at its gate — with those pages failed; the read's pages are freed
    once it ends."""
    cache, gates = gated(tmp_path, prefetch_policy="timeout", prefetch_timeout_max_s=0.05)

    def load(tokens: list[int]) -> Awaitable[tuple[OpHandle | None, Hit]]:
        cache.io.read_rate.observe(1, 10.0)  # measured: a crawl; the cap decides
        return cache.load(tokens, {"full": [8, 9, 10, 11]})

    await a_hanging_read_is_left_behind(cache, gates, load)


@pytest.mark.asyncio
async def test_a_down_l3_misses_at_once_under_the_auto_deadline(tmp_path: Path) -> None:
    cache, faulty = build(tmp_path, "qwen2_7b.json", host_pages=16, prefetch_policy="timeout")
    try:
        async with cache.running():
            tokens = list(range(4 * PAGE))
            await only_in_l3(cache, tokens, 0)
            faulty.down = True
            handle, hit = await cache.load(tokens, {"full": [8, 9, 10, 11]})
            assert (handle, hit.failed) == (None, {"full": (0, 1, 2, 3)})
            assert cache.io.read_rate.samples == 0  # a failed read measures nothing
            await cache.drain()
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_a_store_attached_in_place_of_another_starts_unmeasured(tmp_path: Path) -> None:
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=16, prefetch_policy="timeout")
    try:
        async with cache.running():
            tokens = list(range(4 * PAGE))
            await only_in_l3(cache, tokens, 0)
            assert await cache.prefetch(tokens) == 4
            assert cache.io.read_rate.samples == 1
            other = FaultyBackend(FileBackend(tmp_path / "other", capacity_bytes=1 << 20))
            cache.attach_l3(GuardedStore(other))
            assert cache.io.read_rate.bytes_per_s() is None
    finally:
        cache.embedded.close()


class Recording(Timeout):
    """The auto policy, remembering the bytes each load's deadline was sized for."""

    def __init__(self) -> None:
        super().__init__(base_s="auto")
        self.sized: list[int] = []

    def wait_s(
        self, tokens: int, l3_bytes: int = 0, read_bytes_per_s: float | None = None
    ) -> float | None:
        self.sized.append(l3_bytes)
        return super().wait_s(tokens, l3_bytes, read_bytes_per_s)


@pytest.mark.asyncio
async def test_reads_in_flight_count_toward_a_new_loads_deadline(tmp_path: Path) -> None:
    """Engines queue behind one another on L3: a load's deadline is sized for its own
    L3-only bytes plus those L3 is still reading for fetches ahead of it."""
    cache, _ = build(tmp_path, "qwen2_7b.json", host_pages=16, prefetch_policy="timeout")
    gates = Gates(tmp_path / "gated")
    cache.attach_l3(GuardedStore(gates, base_timeout_s=60.0))
    policy = cache.prefetch_policy = Recording()
    page_bytes = cache.embedded.host_tier.pool("full").geometry.page_bytes
    try:
        async with cache.running():
            first, second = list(range(4 * PAGE)), list(range(100, 100 + 4 * PAGE))
            await only_in_l3(cache, first, 0)
            await only_in_l3(cache, second, 4)
            gates.read_gate.clear()
            ahead = asyncio.create_task(cache.prefetch(first))
            await parked(gates)
            assert cache.io.reading_bytes == 4 * page_bytes
            loading = asyncio.create_task(cache.load(second, {"full": [8, 9, 10, 11]}))
            deadline = time.monotonic() + 60  # bounds a hang only (#26: a busy machine)
            while time.monotonic() < deadline:
                if policy.sized:
                    break
                await asyncio.sleep(0.001)
            assert policy.sized == [8 * page_bytes]
            gates.read_gate.set()
            assert await ahead == 4
            handle, _ = await loading
            if handle is not None:
                await handle.done()
            await cache.drain()
            assert cache.io.reading_bytes == 0
            assert cache.io.read_rate.samples == 2
            assert_consistent(cache)
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_a_keyed_load_with_its_own_l3_wait_waits_it_out_instead_of_the_policy(
    tmp_path: Path,
) -> None:
    """`load_keys(l3_wait_s=...)` (SGLang's prefetch IO thread: rather wait than miss): the
    policy's fixed 2 ms would miss a read of SLOW_READ_S; the caller's wait of 30 s serves
    it. A read that never returns costs such a load its wait, not more."""
    cache, faulty = build(
        tmp_path, "qwen2_7b.json", host_pages=16, prefetch_policy="timeout",
        prefetch_timeout_s=0.002,
    )  # fmt: skip
    try:
        async with cache.running():
            tokens = list(range(4 * PAGE))
            await only_in_l3(cache, tokens, 0)
            keys = cache.index.keys(tokens)
            faulty.latency_s = SLOW_READ_S
            handle, hit = await cache.load_keys(keys, {"full": [8, 9, 10, 11]}, l3_wait_s=30.0)
            assert (hit.tokens_total, hit.failed) == (4 * PAGE, {})
            assert handle is not None
            assert (await handle.done()).ok
            await cache.drain()
            cache.clear_l2()
            handle, hit = await cache.load_keys(keys, {"full": [8, 9, 10, 11]})  # the policy's
            assert (handle, hit.failed) == (None, {"full": (0, 1, 2, 3)})
            await cache.drain()
            assert_consistent(cache)
    finally:
        cache.embedded.close()

    hanging, gates = gated(tmp_path / "gated-cache")

    def load_keys(tokens: list[int]) -> Awaitable[tuple[OpHandle | None, Hit]]:
        keys = hanging.index.keys(tokens)
        return hanging.load_keys(keys, {"full": [8, 9, 10, 11]}, l3_wait_s=0.05)

    await a_hanging_read_is_left_behind(hanging, gates, load_keys)
