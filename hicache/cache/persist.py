"""`PersistQueue`: L2 -> L3 writes, off the critical path, through a bounded queue.

A store is acknowledged once L2 holds its pages; the pages the write policy wants in L3 are
offered here and written behind it by one worker task (owned by the cache's TaskGroup, see
`TieredCache.running`). Lifecycle: `offer` (never blocks: beyond `max_pages` waiting, the
new pages are dropped and counted — back-pressure on a store would put L3's latency back on
the engine's path; only pages really waiting count, not the entries left behind by pages
withdrawn or replaced since, which the worker skips) -> the worker takes up to `batch_pages`
at a time and calls the writer -> `idle()` returns once nothing is waiting or being
written (tests, shutdown flush). A page evicted from L2 before its turn is skipped and
counted; a write that fails is counted (the guarded store already turned it into "not
stored"). When L3 is detached or replaced
(`TieredCache.attach_l3`), `detach()` drops what waits — offered for the store that left —
and counts it (`detached_pages`); the batch being written then finishes on that store.
Each batch end, withdrawal and detach wakes `next_change` (a store waiting for its pages to
reach L3, `writing.until_persisted`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from hicache.index import PageRecord

Writer = Callable[[Mapping[str, Sequence[PageRecord]]], Awaitable[tuple[int, int]]]
# -> (pages written, pages skipped: no longer in L2, or in L3 already)


@dataclass(frozen=True, slots=True)
class PersistStats:
    queued_pages: int  # waiting now (withdrawn or replaced entries not counted)
    offered_pages: int
    dropped_pages: int  # the queue was full
    written_pages: int
    skipped_pages: int  # left L2 (or reached L3 another way) before their turn
    failed_pages: int
    detached_pages: int = 0  # waiting when L3 was detached or replaced: dropped
    # in the batch being written now (pinned while L3 reads them); with `queued_pages`, 0
    # means idle: every write behind an acknowledged store has ended and let go of L2
    writing_pages: int = 0


class PersistQueue:
    def __init__(self, max_pages: int = 65_536, batch_pages: int = 256):
        if max_pages < 1 or batch_pages < 1:
            raise ValueError(
                f"persist queue: max_pages {max_pages} and batch_pages {batch_pages} must be >= 1"
            )
        self.max_pages = max_pages
        self.batch_pages = batch_pages
        self._items: deque[tuple[str, PageRecord]] = deque()
        # (group, key) -> the record queued for it: a key stored again after its record left
        # L2 is a new record, and the one to write
        self._waiting: dict[tuple[str, bytes], PageRecord] = {}
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._batch_done = asyncio.Event()  # cleared while a batch is being written
        self._batch_done.set()
        # set (and replaced) at every change a persist wait looks at: a batch ended, pages
        # withdrawn, or dropped at a detach (`next_change`)
        self._changed = asyncio.Event()
        self._offered = self._dropped = self._written = self._skipped = self._failed = 0
        self._detached = 0
        self._writing = 0  # pages of the batch being written

    def offer(self, records: Mapping[str, Sequence[PageRecord]]) -> int:
        """Queue the pages for L3; returns how many were accepted (the rest dropped)."""
        accepted = 0
        for group, group_records in records.items():
            for record in group_records:
                self._offered += 1
                slot = (group, record.key)
                queued = self._waiting.get(slot)
                if queued is record:
                    continue  # queued already
                if queued is None and len(self._waiting) >= self.max_pages:
                    self._dropped += 1  # (a record replacing a queued one takes its place)
                    continue
                self._waiting[slot] = record  # a stale record in `_items` is skipped
                self._items.append((group, record))
                accepted += 1
        if len(self._items) > 2 * self.max_pages:
            self._compact()
        if accepted:
            self._idle.clear()
            self._wakeup.set()
        return accepted

    def _compact(self) -> None:
        """Forget the entries of `_items` no longer waiting (withdrawn or replaced). Run when
        `_items` passes twice the limit, it leaves at most `max_pages`: at least `max_pages`
        offers pass between two runs, so each costs O(1) amortised and `_items` stays bounded
        while the worker is held up (a slow L3) and stores withdraw and re-offer pages."""
        self._items = deque(
            (group, record)
            for group, record in self._items
            if self._waiting.get((group, record.key)) is record
        )

    async def run(self, write: Writer) -> None:
        """The worker: write batches until cancelled (a batch in flight is finished first:
        the writer pins the pages it reads and must unpin them)."""
        while True:
            if not self._items:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch: dict[str, list[PageRecord]] = {}
            while self._items and sum(len(v) for v in batch.values()) < self.batch_pages:
                group, record = self._items.popleft()
                if self._waiting.get((group, record.key)) is not record:
                    continue  # withdrawn (someone else writes it), or replaced by a newer one
                del self._waiting[(group, record.key)]
                batch.setdefault(group, []).append(record)
            size = sum(len(v) for v in batch.values())
            if not size:
                continue
            self._batch_done.clear()
            self._writing = size
            task = asyncio.ensure_future(write(batch))
            try:
                written, skipped = await asyncio.shield(task)
            except asyncio.CancelledError:
                await asyncio.wait({task})  # the batch ends first: its pages are unpinned
                raise
            except Exception:  # the guarded store maps L3 errors; anything else is counted
                self._failed += size
                continue
            finally:
                self._writing = 0
                self._batch_done.set()
                self._change()
            self._written += written
            self._skipped += skipped
            self._failed += size - written - skipped

    def withdraw(self, records: Mapping[str, Sequence[PageRecord]]) -> None:
        """Take queued pages back: their caller writes them itself, now (a store that needs
        their room)."""
        for group, group_records in records.items():
            for record in group_records:
                if self._waiting.get((group, record.key)) is record:
                    del self._waiting[(group, record.key)]
        self._change()

    def detach(self) -> int:
        """L3 was detached or replaced: drop every page waiting (offered for the store that
        left; counted), and return how many. A batch being written finishes on that store."""
        dropped = len(self._waiting)
        self._detached += dropped
        self._waiting.clear()
        self._items.clear()  # the worker, finding nothing, reports idle
        self._wakeup.set()
        self._change()
        return dropped

    def _change(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def next_change(self) -> Awaitable[bool]:
        """Until the next batch end, withdrawal or detach after this call (the event is taken
        now: a change before the returned awaitable first runs still ends it)."""
        return self._changed.wait()

    def waiting(self, group: str, record: PageRecord) -> bool:
        """Is the page queued (not yet taken by the worker)?"""
        return self._waiting.get((group, record.key)) is record

    @property
    def writing(self) -> bool:
        """A batch is being written now (its pages are pinned while L3 reads them)."""
        return not self._batch_done.is_set()

    async def batch_end(self) -> None:
        """Until the batch being written now (if any) has ended."""
        await self._batch_done.wait()

    async def idle(self) -> None:
        """Until nothing is waiting or being written."""
        await self._idle.wait()

    def stats(self) -> PersistStats:
        return PersistStats(
            len(self._waiting),
            self._offered,
            self._dropped,
            self._written,
            self._skipped,
            self._failed,
            self._detached,
            self._writing,
        )
