"""`PersistQueue` (hicache/cache/persist.py) on its own: its limit counts the pages really
waiting, not the entries left behind by pages withdrawn (a store writing them itself) or
replaced (a key stored again), and those entries stay bounded while the worker is held up."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest

from hicache.cache.persist import PersistQueue
from hicache.index import PageRecord


def records(*names: str) -> list[PageRecord]:
    return [PageRecord(name.encode()) for name in names]


class Recorder:
    """A writer that keeps what it was given (every page written)."""

    def __init__(self) -> None:
        self.written: list[PageRecord] = []

    async def __call__(self, batch: Mapping[str, Sequence[PageRecord]]) -> tuple[int, int]:
        pages = [record for group in batch.values() for record in group]
        self.written.extend(pages)
        return len(pages), 0


async def drain(queue: PersistQueue) -> Recorder:
    """Run the worker until the queue is idle; what it wrote."""
    recorder = Recorder()
    worker = asyncio.create_task(queue.run(recorder))
    try:
        await asyncio.wait_for(queue.idle(), timeout=60)
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
    return recorder


@pytest.mark.asyncio
async def test_withdrawn_pages_do_not_count_against_the_limit() -> None:
    queue = PersistQueue(max_pages=4)
    first = records("a", "b", "c", "d")
    assert queue.offer({"g": first}) == 4
    queue.withdraw({"g": first})  # a store writes them itself: nothing really waits now
    assert queue.stats().queued_pages == 0
    new = records("e", "f", "g", "h")
    assert queue.offer({"g": new}) == 4
    stats = queue.stats()
    assert (stats.queued_pages, stats.dropped_pages) == (4, 0)
    written = (await drain(queue)).written
    assert written == new  # the withdrawn ones are not written by the worker


@pytest.mark.asyncio
async def test_replaced_pages_do_not_count_against_the_limit() -> None:
    queue = PersistQueue(max_pages=8)
    assert queue.offer({"g": records("a", "b", "c", "d")}) == 4
    again = records("a", "b", "c", "d")  # the same keys stored again: new records
    assert queue.offer({"g": again}) == 4
    assert queue.stats().queued_pages == 4
    new = records("e", "f", "g", "h")
    assert queue.offer({"g": new}) == 4
    stats = queue.stats()
    assert (stats.queued_pages, stats.dropped_pages) == (8, 0)
    written = (await drain(queue)).written
    assert written == again + new


@pytest.mark.asyncio
async def test_beyond_the_limit_of_pages_really_waiting_new_pages_are_dropped() -> None:
    queue = PersistQueue(max_pages=4)
    assert queue.offer({"g": records("a", "b", "c")}) == 3
    assert queue.offer({"g": records("d", "e"), "h": records("a")}) == 1  # "d" only
    stats = queue.stats()
    assert (stats.queued_pages, stats.offered_pages, stats.dropped_pages) == (4, 6, 2)
    replacing = records("a")  # takes the place of the queued "a": not beyond the limit
    assert queue.offer({"g": replacing}) == 1
    assert queue.stats().queued_pages == 4
    written = (await drain(queue)).written
    assert [r.key for r in written] == [b"b", b"c", b"d", b"a"]
    assert written[-1] is replacing[0]


@pytest.mark.asyncio
async def test_entries_left_behind_stay_bounded_while_the_worker_is_held_up() -> None:
    queue = PersistQueue(max_pages=4)
    latest: dict[bytes, PageRecord] = {}
    for round_ in range(200):  # no worker runs: nothing leaves but by withdraw / replace
        batch = records(f"k{round_ % 3}", f"x{round_}")  # k0..k2 replaced, x withdrawn
        latest[batch[0].key] = batch[0]
        assert queue.offer({"g": batch}) == 2
        queue.withdraw({"g": batch[1:]})
        assert len(queue._items) <= 2 * queue.max_pages + 2  # the compaction keeps it bounded
    stats = queue.stats()
    assert (stats.queued_pages, stats.dropped_pages) == (3, 0)
    written = (await drain(queue)).written
    assert sorted(r.key for r in written) == [b"k0", b"k1", b"k2"]
    assert all(record is latest[record.key] for record in written)  # the newest records


@pytest.mark.asyncio
async def test_a_batch_being_written_is_counted_until_its_write_returns() -> None:
    """`writing_pages` covers the gap between the worker taking a batch (no longer queued)
    and the write returning (the pages let go): idle is both counters at 0 (#32)."""
    queue = PersistQueue(batch_pages=3)
    started = asyncio.Event()
    releases: asyncio.Queue[None] = asyncio.Queue()  # one item lets one batch's write return

    async def held_writer(batch: Mapping[str, Sequence[PageRecord]]) -> tuple[int, int]:
        started.set()
        await releases.get()
        return sum(len(group) for group in batch.values()), 0

    queue.offer({"g": records("a", "b", "c", "d")})
    worker = asyncio.create_task(queue.run(held_writer))
    try:
        await asyncio.wait_for(started.wait(), timeout=60)
        stats = queue.stats()
        assert (stats.queued_pages, stats.writing_pages, stats.written_pages) == (1, 3, 0)
        started.clear()
        releases.put_nowait(None)
        await asyncio.wait_for(started.wait(), timeout=60)  # the second batch: "d"
        stats = queue.stats()
        assert (stats.queued_pages, stats.writing_pages, stats.written_pages) == (0, 1, 3)
        releases.put_nowait(None)
        await asyncio.wait_for(queue.idle(), timeout=60)
        stats = queue.stats()
        assert (stats.queued_pages, stats.writing_pages, stats.written_pages) == (0, 0, 4)
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
