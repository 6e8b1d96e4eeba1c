"""What a fetch from L3 returns (`Fetched`, `FetchedInto`) and the handle of a running
`fetch_into` (`FetchInto`), with the tracking of the backend threads that may still write its
target pages (`Outstanding`): the lifecycle is in `guarded.py`'s docstring."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Generator, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Fetched:
    values: list[memoryview | None]
    answered: bool  # False: the backend failed or the breaker is open; the Nones are unknown
    timed_out: bool = False  # the backend did not answer within the call's timeout


@dataclass(frozen=True, slots=True)
class FetchedInto:
    """The outcome of `fetch_into` (see the module docstring for the lifecycle)."""

    ok: list[bool]  # per key: read whole and verified in its targets
    answered: bool  # every key answered (False: a failure, a timeout or an open breaker)
    answered_keys: list[bool]  # per key: the backend answered (ok False: a definite miss)
    timed_out: bool  # a read was still running when the store stopped waiting
    settled: asyncio.Future[None]  # done once no thread of this fetch touches the targets

    def __iter__(self) -> Iterator[Any]:
        """`ok, answered = result`: the shape callers unpacked before `settled`."""
        yield self.ok
        yield self.answered


class Outstanding:
    """The futures of one fetch that may still touch its targets; `settled` is done once the
    fetch is `close`d (starts nothing more) and every tracked future is done."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.settled: asyncio.Future[None] = loop.create_future()
        self._futures: list[asyncio.Future[Any]] = []
        self._closed = False

    def track(self, future: asyncio.Future[Any]) -> None:
        self._futures.append(future)
        future.add_done_callback(self._check)

    @property
    def idle(self) -> bool:
        return all(f.done() for f in self._futures)

    def close(self) -> None:
        self._closed = True
        self._check()

    def _check(self, _: object = None) -> None:
        if self._closed and not self.settled.done() and self.idle:
            self.settled.set_result(None)


class FetchInto:
    """A running `fetch_into`: await it for the `FetchedInto`; `settled` is available at once,
    so a caller cancelled while awaiting can still tell when its pages are free."""

    def __init__(self, run: Callable[[Outstanding], Coroutine[Any, Any, FetchedInto]]) -> None:
        loop = asyncio.get_running_loop()
        self._outstanding = Outstanding(loop)
        self._task = loop.create_task(run(self._outstanding))
        self._task.add_done_callback(lambda _: self._outstanding.close())

    @property
    def settled(self) -> asyncio.Future[None]:
        return self._outstanding.settled

    def cancel(self) -> None:
        """Stop waiting and start no further chunk; `settled` still waits for the threads."""
        self._task.cancel()

    def done(self) -> bool:
        return self._task.done()

    def __await__(self) -> Generator[Any, None, FetchedInto]:
        return self._task.__await__()


def retrieve_quietly(future: asyncio.Future[Any]) -> None:
    """A late call's error is nobody's to raise: mark it retrieved (no asyncio warning)."""
    if not future.cancelled():
        future.exception()
