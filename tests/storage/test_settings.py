"""The L3 tier's knobs are constructor parameters with today's defaults, checked where they
are given (the error names the parameter, the value and what is allowed), and a trial call
whose caller is cancelled does not wedge the breaker half-open."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hicache.storage import BreakerState, CircuitBreaker, FileBackend, GuardedStore
from hicache.testing.faulty_storage import FaultyBackend


def test_defaults_are_unchanged(tmp_path: Path) -> None:
    store = GuardedStore(FileBackend(tmp_path, capacity_bytes=1 << 20))
    assert store.base_timeout_s == 1.0
    assert store.min_bandwidth == 50e6
    assert store.chunk_bytes == 16 << 20
    assert store.breaker.failure_threshold == 3
    assert store.breaker.reset_after_s == 5.0
    assert FileBackend(tmp_path, capacity_bytes=1).stale_tmp_after_s == 600.0


def test_breaker_thresholds_through_the_store(tmp_path: Path) -> None:
    store = GuardedStore(
        FileBackend(tmp_path, capacity_bytes=1 << 20), failure_threshold=1, reset_after_s=0.25
    )
    assert (store.breaker.failure_threshold, store.breaker.reset_after_s) == (1, 0.25)
    with pytest.raises(ValueError, match=r"breaker= was given together with failure_threshold="):
        GuardedStore(store.backend, breaker=CircuitBreaker(), failure_threshold=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_timeout_s": 0}, r"^GuardedStore base_timeout_s=0: must be a finite number > 0$"),
        ({"base_timeout_s": float("inf")}, r"^GuardedStore base_timeout_s=inf: must be a finite"),
        (
            {"min_bandwidth_bytes_per_s": -1.0},
            r"^GuardedStore min_bandwidth_bytes_per_s=-1.0: must be a finite number > 0$",
        ),
        ({"chunk_bytes": 0}, r"^GuardedStore chunk_bytes=0: must be an int >= 1$"),
        ({"failure_threshold": 0}, r"^CircuitBreaker failure_threshold=0: must be >= 1"),
        ({"reset_after_s": -1}, r"^CircuitBreaker reset_after_s=-1: must be a finite number"),
    ],
)
def test_bad_values_are_refused_by_name(
    tmp_path: Path, kwargs: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        GuardedStore(FileBackend(tmp_path, capacity_bytes=1 << 20), **kwargs)  # type: ignore[arg-type]


def test_other_knobs_are_checked(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"^CircuitBreaker failure_threshold=2.5: must be an int"):
        CircuitBreaker(2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^FileBackend stale_tmp_after_s=-1: must be >= 0"):
        FileBackend(tmp_path, capacity_bytes=1, stale_tmp_after_s=-1)
    with pytest.raises(ValueError, match=r"^FaultyBackend scatter_latency_s=-0.5: must be >= 0"):
        FaultyBackend(FileBackend(tmp_path, capacity_bytes=1), scatter_latency_s=-0.5)


@pytest.mark.asyncio
async def test_a_cancelled_trial_call_frees_the_half_open_breaker(tmp_path: Path) -> None:
    now = [0.0]
    slow = FaultyBackend(FileBackend(tmp_path, capacity_bytes=1 << 20))
    store = GuardedStore(slow, breaker=CircuitBreaker(1, reset_after_s=1.0, clock=lambda: now[0]))
    slow.down = True
    assert await store.get([b"a" * 16]) == [None]
    assert store.breaker.state is BreakerState.OPEN
    slow.down, slow.latency_s = False, 5.0
    now[0] = 1.0  # half-open: the next call is the trial
    trial = asyncio.ensure_future(store.get([b"a" * 16]))
    await asyncio.sleep(0.05)
    trial.cancel()  # its caller gave up: no verdict either way
    with pytest.raises(asyncio.CancelledError):
        await trial
    slow.latency_s = 0.0
    assert await store.exists([b"a" * 16]) == [False]  # a new trial went through
    assert store.breaker.state is BreakerState.CLOSED
    assert store.stats.skipped_open == 0
