"""`GuardedCalls.call` cancelled in the loop step its backend call finishes: the caller ends
cancelled (a shutdown that cancels a store stops it) and the breaker hears neither a success
nor a failure. On Python 3.11 `asyncio.wait_for` returned the result there and dropped the
cancel; the calls run under `asyncio.timeout`, which keeps it."""

from __future__ import annotations

import asyncio

import pytest

from hicache.storage.breaker import CircuitBreaker
from hicache.storage.calls import GuardedCalls
from hicache.storage.guarded import StoreStats

pytestmark = pytest.mark.asyncio


def calls(base_timeout_s: float = 30) -> GuardedCalls:
    breaker = CircuitBreaker(failure_threshold=1, reset_after_s=60)
    return GuardedCalls(breaker, StoreStats(), base_timeout_s=base_timeout_s, min_bandwidth=1e9)


async def started_get(
    guarded: GuardedCalls,
) -> tuple[asyncio.Task[tuple[str | None, str | None]], asyncio.Future[str]]:
    """A `get` through `guarded`, waiting on the backend's future (which the test resolves)."""
    backend: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def get() -> str:
        return await backend

    task = asyncio.create_task(guarded.call_why("get", 0, get))
    for _ in range(10):  # the task reaches its await on the backend's future
        await asyncio.sleep(0)
    assert not task.done()
    assert not backend.done()
    return task, backend


async def test_a_cancel_landing_as_the_backend_answers_ends_the_caller() -> None:
    guarded = calls()
    task, backend = await started_get(guarded)
    backend.set_result("bytes")  # the answer and the cancel land in one step
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert guarded.breaker.describe()["state"] == "closed"
    assert sum(guarded.stats.failures.values()) == 0


async def test_a_cancel_while_the_backend_works_ends_the_caller() -> None:
    task, backend = await started_get(calls())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.cancelled()  # the backend's call was cancelled with it


async def test_the_timeout_still_turns_a_slow_call_into_a_miss() -> None:
    guarded = calls(base_timeout_s=0.01)

    async def slow() -> str:
        await asyncio.sleep(60)
        return "late"

    assert await guarded.call_why("get", 0, slow) == (None, "timeout")
    assert guarded.stats.failures["get:timeout"] == 1
