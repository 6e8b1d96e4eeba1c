"""`GuardedCalls`: every call `GuardedStore` makes of its backend, under the circuit
breaker and a timeout scaled by the call's bytes (`base_timeout_s + nbytes /
min_bandwidth`). A call the breaker skips, one that times out and one that raises come back
as None with the reason ("open", "timeout", the exception's name); failures are counted by
"what:how" in the store's `StoreStats` and told to the breaker, never raised.

    value = await calls.call("get", nbytes, lambda: backend.get_many(keys))   # None: a miss
    call = calls.launch(start, outstanding)        # a call whose threads write caller memory:
    value, why = await calls.settle_call("get", nbytes, call)   # never cancelled, tracked

`call` cancels a call that timed out, so it is only for calls whose threads touch no caller
memory that outlives them; `launch` / `settle_call` leave a late call running, tracked in
the fetch's `Outstanding` until its threads end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from hicache.storage.breaker import CircuitBreaker
from hicache.storage.fetch_handles import Outstanding, retrieve_quietly

if TYPE_CHECKING:
    from hicache.storage.guarded import StoreStats

T = TypeVar("T")


class GuardedCalls:
    def __init__(
        self,
        breaker: CircuitBreaker,
        stats: StoreStats,
        base_timeout_s: float,
        min_bandwidth: float,
    ):
        self.breaker = breaker
        self.stats = stats  # the store's: skipped calls and failures are counted there
        self.base_timeout_s = base_timeout_s
        self.min_bandwidth = min_bandwidth  # bytes per second

    def failed(
        self,
        reason: str,
        exc: BaseException | None = None,
        note: str | None = None,
        count: int = 1,
    ) -> None:
        """Count a failed call (or `count` failed keys) under `reason` ("what:how") and
        tell the breaker why, once."""
        self.stats.failures[reason] += count
        detail = note if exc is None else str(exc)
        self.breaker.failure(reason if not detail else f"{reason}: {detail[:200]}")

    def timeout(self, nbytes: int) -> float:
        return self.base_timeout_s + nbytes / self.min_bandwidth

    async def call(
        self, what: str, nbytes: int, coro_factory: Callable[[], Awaitable[T]]
    ) -> T | None:
        """Run one backend call under the breaker and a timeout; None means 'treat as miss'."""
        return (await self.call_why(what, nbytes, coro_factory))[0]

    async def call_why(
        self, what: str, nbytes: int, coro_factory: Callable[[], Awaitable[T]]
    ) -> tuple[T | None, str | None]:
        """`call`, and why it gave None: "open", "timeout" or the exception's name. On a
        timeout the call is cancelled: only for calls whose threads touch no caller memory
        that outlives them (scatter reads go through `launch` / `settle_call`)."""
        if not self.breaker.allow():
            self.stats.skipped_open += 1
            return None, "open"
        try:
            # not wait_for: on Python 3.11 it drops a cancel landing as the call ends
            async with asyncio.timeout(self.timeout(nbytes)):
                result = await coro_factory()
        except TimeoutError:
            self.failed(f"{what}:timeout")
            return None, "timeout"
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        except Exception as exc:  # every backend error becomes a miss; counted by reason
            self.failed(f"{what}:{type(exc).__name__}", exc)
            return None, type(exc).__name__
        self.breaker.success()
        return result, None

    def launch(
        self, start: Callable[[], Awaitable[T]], outstanding: Outstanding
    ) -> asyncio.Future[T] | None:
        """Start a call whose threads write caller memory now (None: the breaker is open),
        tracked in `outstanding`: on a timeout or a cancelled caller it is left running, never
        cancelled, until it ends."""
        if not self.breaker.allow():
            self.stats.skipped_open += 1
            return None
        call = asyncio.ensure_future(start())
        call.add_done_callback(retrieve_quietly)
        outstanding.track(call)
        return call

    async def settle_call(
        self, what: str, nbytes: int, call: asyncio.Future[T]
    ) -> tuple[T | None, str | None]:
        """Wait for a `launch`ed call within the timeout for `nbytes`. The breaker's failure is
        recorded here; its success is the caller's to record (a result may still hold failed
        keys)."""
        try:
            done, _ = await asyncio.wait({call}, timeout=self.timeout(nbytes))
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        if not done:
            self.failed(f"{what}:timeout")
            return None, "timeout"
        exc = call.exception() if not call.cancelled() else asyncio.CancelledError()
        if exc is not None:
            self.failed(f"{what}:{type(exc).__name__}", exc)
            return None, type(exc).__name__
        return call.result(), None
