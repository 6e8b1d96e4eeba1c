"""Time for the scheduler, injected so deadline tests never really sleep.

`MonotonicClock` is the real one. `FakeClock` (shipped for tests, like httpx's MockTransport)
only moves when told: `advance(dt)` fires every timer whose time has come (on the caller's
thread: the test's event loop).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float: ...

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Timer:
        """Run `callback` on the event loop after `seconds` (a deadline timer)."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Timer:
        return asyncio.get_running_loop().call_later(max(0.0, seconds), callback)


class FakeClock:
    def __init__(self, start: float = 0.0):
        self._now = start
        self._timers: list[tuple[float, int, _FakeTimer]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self._now

    def call_later(self, seconds: float, callback: Callable[[], None]) -> Timer:
        timer = _FakeTimer(callback)
        heapq.heappush(self._timers, (self._now + seconds, next(self._order), timer))
        return timer

    def advance(self, seconds: float) -> None:
        self._now += seconds
        while self._timers and self._timers[0][0] <= self._now:
            _, _, timer = heapq.heappop(self._timers)
            timer.fire()


class _FakeTimer:
    def __init__(self, callback: Callable[[], None]):
        self._callback: Callable[[], None] | None = callback

    def cancel(self) -> None:
        self._callback = None

    def fire(self) -> None:
        callback, self._callback = self._callback, None
        if callback is not None:
            callback()
