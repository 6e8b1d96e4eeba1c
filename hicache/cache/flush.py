"""`Flusher`: the tiered cache's L2 -> L3 writes, tracked while in flight — the persist
worker's batches, a store's write-back victims, and the flush of every page L3 lacks
(`TieredCache.flush` / `flush_within`, what the shutdown drain runs).

    written, skipped = await flusher.write(records)   # (0, 0): abandoned at a deadline
    flushed = await flusher.flush_within(timeout_s)   # Flushed: written, and what L3 lacks

Each write goes through `L3Io.write` (pins while read, marks in L3 once acknowledged) and is
tracked until it ends, so a bounded flush can cancel the writes in flight at its deadline
(the caller's own cancellation still propagates). The flush empties the persist queue
first, then writes what is still owed a batch at a time; at the deadline it stops the
backend's writes, drops the queue (counted as detached) and counts what L3 still lacks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from hicache.cache.l3_io import L3Io
from hicache.cache.persist import PersistQueue
from hicache.index import PageRecord, PrefixIndex
from hicache.storage import GuardedStore


@dataclass(frozen=True, slots=True)
class Flushed:
    """What a bounded flush did: pages written, and the pages (and their bytes) L3 still
    lacked when it ended (0 when it finished, or when there is no L3)."""

    written: int
    left_pages: int
    left_bytes: int


class Flusher:
    def __init__(
        self,
        index: PrefixIndex,
        persist: PersistQueue,
        io: L3Io,
        l3: Callable[[], GuardedStore | None],
        running: Callable[[], bool],
    ):
        self.index = index
        self.persist = persist
        self.io = io
        self._l3 = l3  # the store attached now (None: none)
        self._running = running  # inside the cache's `running()`: the persist worker runs
        self._writes: set[asyncio.Future[tuple[int, int]]] = set()  # L2 -> L3 in flight

    async def write(self, records: Mapping[str, Sequence[PageRecord]]) -> tuple[int, int]:
        """The persist worker's writer (and write-back victims', and the flush's). A write
        abandoned at the drain's deadline (`flush_within`) returns (0, 0): nothing written."""
        write = asyncio.ensure_future(self.io.write(self._l3(), records))
        self._writes.add(write)
        try:
            return await write
        except asyncio.CancelledError:
            caller = asyncio.current_task()
            if caller is not None and caller.cancelling():
                raise  # the caller was cancelled (the write with it)
            return 0, 0
        finally:
            self._writes.discard(write)

    async def flush_within(self, timeout_s: float | None) -> Flushed:
        """`TieredCache.flush_within`, which says what happens at the deadline."""
        deadline = None
        if timeout_s is not None:
            deadline = asyncio.get_running_loop().time() + max(0.0, timeout_s)
        written = 0
        try:
            async with asyncio.timeout_at(deadline):
                if self._running():
                    await self.persist.idle()
                for batch in self._owed_batches():
                    done, _ = await self.write(batch)
                    written += done
        except TimeoutError:
            l3 = self._l3()
            if l3 is not None:  # puts on backend threads end after their current object
                l3.backend.stop_writes()
            if self._running():
                self.persist.detach()  # nobody writes them now: counted below as left
            writes = list(self._writes)  # the persist worker's batch: abandoned too
            for write in writes:
                write.cancel()
            if writes:
                await asyncio.wait(writes)
        left_pages = left_bytes = 0
        if self._l3() is not None:
            for group, records in self._owed().items():
                left_pages += len(records)
                left_bytes += len(records) * self.io.host_tier.pool(group).geometry.page_bytes
        return Flushed(written, left_pages, left_bytes)

    def _owed(self) -> dict[str, list[PageRecord]]:
        """Every L2 page L3 lacks, by group."""
        return {
            group: [r for r in self.index.l2_records(group) if not r.in_l3]
            for group in self.index.rules
        }

    def _owed_batches(self) -> Iterator[dict[str, list[PageRecord]]]:
        batch: dict[str, list[PageRecord]] = {}
        size = 0
        for group, records in self._owed().items():
            for record in records:
                batch.setdefault(group, []).append(record)
                size += 1
                if size >= self.persist.batch_pages:
                    yield batch
                    batch, size = {}, 0
        if batch:
            yield batch
