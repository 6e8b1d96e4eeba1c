"""A fetch into host pages that times out returns promptly, but the pages may be reused only
once `settled` is done: no backend thread writes them after that, and `settled` waits for the
thread. A timed-out read is never verified or marked good.

The reads that outlast their caller are held on their thread by a gate the test opens (a
hung disk), never by a sleep: "still running" is a state here, not a race with the clock."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from hicache.storage import FileBackend, GuardedStore
from hicache.testing.faulty_storage import FaultyBackend

KEY = b"k" * 16
PAGE = 8192


def _slow_store(tmp_path: Path, scatter_latency_s: float) -> tuple[GuardedStore, FaultyBackend]:
    faulty = FaultyBackend(
        FileBackend(tmp_path, capacity_bytes=1 << 20),
        vectored=True,
        scatter_latency_s=scatter_latency_s,
    )
    return GuardedStore(faulty, base_timeout_s=0.05, min_bandwidth_bytes_per_s=1e12), faulty


class _HeldReads(FileBackend):
    """A real file backend whose reads wait on their thread until `gate` is set (a hung
    disk), then land in the caller's pages; `landed` counts the reads that wrote them."""

    def __init__(self, root: Path, capacity_bytes: int = 1 << 20) -> None:
        super().__init__(root, capacity_bytes=capacity_bytes)
        self.gate = threading.Event()
        self.landed = 0

    async def get_parts_many(
        self,
        keys: Sequence[bytes],
        targets: Sequence[Sequence[memoryview]],
        *,
        landed: object = None,  # not reported: the store verifies after the call
    ) -> list[int]:
        def run() -> list[int]:
            if not self.gate.wait(60):  # the deadline bounds a hang only
                raise TimeoutError("the test never opened the gate")
            got = [self._get_parts(k, t) for k, t in zip(keys, targets, strict=True)]
            self.landed += 1
            return got

        return await asyncio.to_thread(run)


def _held_store(tmp_path: Path, **kwargs: float) -> tuple[GuardedStore, _HeldReads]:
    held = _HeldReads(tmp_path)
    store = GuardedStore(held, base_timeout_s=0.05, min_bandwidth_bytes_per_s=1e12)
    for name, value in kwargs.items():
        setattr(store, name, value)
    return store, held


@pytest.mark.asyncio
async def test_timed_out_fetch_returns_at_once_and_settled_waits_for_the_thread(
    tmp_path: Path,
) -> None:
    store, held = _held_store(tmp_path)
    held.gate.set()
    assert await store.put([(KEY, b"A" * PAGE)]) == [True]
    held.gate.clear()  # the disk hangs from here: the read outlasts its timeout
    page = memoryview(bytearray(PAGE))
    # the load gives up waiting: it returns while the read is still held on its thread
    fetched = await asyncio.wait_for(store.fetch_into([KEY], [[page]]), 60)
    assert fetched.ok == [False]
    assert not fetched.answered
    assert fetched.answered_keys == [False]
    assert fetched.timed_out
    assert not fetched.settled.done()  # the read's thread is still running
    held.gate.set()
    await asyncio.wait_for(fetched.settled, 60)  # settled waited for the thread...
    assert held.landed == 1  # ...which had written the page by then
    page[:] = b"B" * PAGE  # now the page is another prefix's
    await asyncio.sleep(0.5)  # time for a stray late write to show (none may)
    assert bytes(page) == b"B" * PAGE  # nothing writes it after settled
    # the late bytes were never verified or counted as a hit
    assert store.stats.hits == 0
    assert store.stats.get_bytes == 0
    assert store.stats.failures["get:timeout"] == 1


@pytest.mark.asyncio
async def test_legacy_unpacking_still_works_and_a_fast_fetch_is_settled_on_return(
    tmp_path: Path,
) -> None:
    store, _ = _slow_store(tmp_path, scatter_latency_s=0.0)
    assert await store.put([(KEY, b"A" * PAGE)]) == [True]
    page = memoryview(bytearray(PAGE))
    fetched = await store.fetch_into([KEY, b"\x01" * 16], [[page], [memoryview(bytearray(PAGE))]])
    assert fetched.settled.done()  # nothing outstanding: already done
    assert fetched.ok == [True, False]
    assert fetched.answered_keys == [True, True]  # the absent key is a definite miss
    ok, answered = fetched  # today's callers unpack (ok, answered)
    assert (ok, answered) == ([True, False], True)
    assert bytes(page) == b"A" * PAGE


@pytest.mark.asyncio
async def test_a_cancelled_fetch_settles_after_the_thread_and_the_handle_knows(
    tmp_path: Path,
) -> None:
    store, held = _held_store(tmp_path, base_timeout_s=60.0)  # the caller gives up by cancelling
    held.gate.set()
    assert await store.put([(KEY, b"A" * PAGE)]) == [True]
    held.gate.clear()
    page = memoryview(bytearray(PAGE))
    fetch = store.fetch_into([KEY], [[page]])  # started at once; the handle has `settled`
    waiter = asyncio.ensure_future(fetch)
    await asyncio.sleep(0.05)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not fetch.settled.done()  # the read is still held on its thread
    freed: list[float] = []
    fetch.settled.add_done_callback(lambda _: freed.append(time.monotonic()))
    held.gate.set()
    await asyncio.wait_for(fetch.settled, 60)
    assert held.landed == 1
    assert freed
    page[:] = b"B" * PAGE
    await asyncio.sleep(0.4)  # time for a stray late write to show (none may)
    assert bytes(page) == b"B" * PAGE
    # the next fetch does not share the abandoned header arena with the stray thread
    assert (await store.fetch_into([KEY], [[page]])).ok == [True]


@pytest.mark.asyncio
async def test_settled_covers_every_chunk_of_a_chunked_fetch(tmp_path: Path) -> None:
    store, held = _held_store(tmp_path, chunk_bytes=PAGE)  # one object per chunk
    held.gate.set()
    keys = [bytes([i]) * 16 for i in range(4)]
    assert await store.put([(k, bytes([i]) * PAGE) for i, k in enumerate(keys)]) == [True] * 4
    pages = [memoryview(bytearray(PAGE)) for _ in keys]
    held.gate.clear()
    fetched = await asyncio.wait_for(store.fetch_into(keys, [[p] for p in pages]), 60)
    assert fetched.timed_out
    assert fetched.ok == [False] * 4
    assert not fetched.settled.done()
    held.gate.set()
    await asyncio.wait_for(fetched.settled, 60)
    for p in pages:
        p[:] = b"\xee" * PAGE
    await asyncio.sleep(0.4)  # time for a stray late write to show (none may)
    assert all(bytes(p) == b"\xee" * PAGE for p in pages)


@pytest.mark.asyncio
async def test_file_backend_readv_after_timeout_never_hits_a_reused_page(tmp_path: Path) -> None:
    store, held = _held_store(tmp_path)  # a slow disk: the readv thread starts late
    held.gate.set()
    assert await store.put([(KEY, b"A" * PAGE)]) == [True]
    held.gate.clear()
    page = memoryview(bytearray(PAGE))
    fetched = await asyncio.wait_for(store.fetch_into([KEY], [[page]]), 60)
    assert fetched.ok == [False]
    assert fetched.timed_out
    held.gate.set()
    await asyncio.wait_for(fetched.settled, 60)  # the rule: free the page only now
    assert held.landed == 1
    page[:] = b"B" * PAGE
    await asyncio.sleep(0.4)  # time for a stray late write to show (none may)
    assert bytes(page) == b"B" * PAGE


class _LazySender(FileBackend):
    """Like the Redis backend: consumes the lazily produced (header, payload) items on its
    own thread, one by one, and here stalls after the first until `gate` is set (past the
    caller's timeout); `done` is set once it has sent them all."""

    vectored_put = True
    chunked_put = False

    def __init__(self, root: Path) -> None:
        super().__init__(root, capacity_bytes=1 << 20)
        self.sent: list[tuple[bytes, bytes]] = []
        self.gate, self.done = threading.Event(), threading.Event()

    async def put_parts_many(self, items):  # type: ignore[no-untyped-def]
        def send() -> list[bool]:
            try:
                for n, (key, parts) in enumerate(items):
                    self.sent.append((key, b"".join(bytes(p) for p in parts)))
                    if n == 0 and not self.gate.wait(60):  # the deadline bounds a hang only
                        raise TimeoutError("the test never opened the gate")
                return [True] * len(self.sent)
            finally:
                self.done.set()

        return await asyncio.to_thread(send)


@pytest.mark.asyncio
async def test_a_timed_out_lazy_put_never_frames_bytes_the_caller_reused(tmp_path: Path) -> None:
    from hicache.errors import ObjectCorruptError
    from hicache.storage.object_format import decode

    backend = _LazySender(tmp_path)
    store = GuardedStore(backend, base_timeout_s=0.05, min_bandwidth_bytes_per_s=1e12)
    pages = [bytearray(bytes([i]) * PAGE) for i in range(3)]
    items = [(bytes([i]) * 16, memoryview(p)) for i, p in enumerate(pages)]
    assert await asyncio.wait_for(store.put(items), 60) == [False] * 3  # timed out
    for p in pages:  # the caller reuses its pages at once
        p[:] = b"\xee" * PAGE
    backend.gate.set()  # the thread goes on with what it is still given, after the reuse
    assert await asyncio.to_thread(backend.done.wait, 60)
    for key, data in backend.sent:  # whatever went out after is never a valid wrong object
        try:
            payload = bytes(decode(key, data))
        except ObjectCorruptError:
            continue
        assert payload != b"\xee" * PAGE, f"{key.hex()} framed the reused page as valid"


@pytest.mark.asyncio
async def test_a_chunked_fetch_in_half_open_serves_every_chunk(tmp_path: Path) -> None:
    """Half-open lets one trial call through: the next chunk's read must not be started
    beside it (it would be refused, and the first fetch after an outage would lose every
    chunk but the first)."""
    store = GuardedStore(
        FileBackend(tmp_path, capacity_bytes=1 << 24),
        chunk_bytes=PAGE,
        failure_threshold=1,
        reset_after_s=0.05,
    )
    keys = [bytes([i]) * 16 for i in range(6)]
    assert await store.put([(k, bytes([i]) * PAGE) for i, k in enumerate(keys)]) == [True] * 6
    store.breaker.failure("test: the backend was down")
    await asyncio.sleep(0.1)
    assert store.breaker.state == "half_open"
    targets = [[memoryview(bytearray(PAGE))] for _ in keys]
    fetched = await store.fetch_into(keys, targets)
    assert fetched.ok == [True] * 6
    assert [bytes(t[0]) for t in targets] == [bytes([i]) * PAGE for i in range(6)]
    assert store.breaker.state == "closed"
    assert store.stats.skipped_open == 0
