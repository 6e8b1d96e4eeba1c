"""`StoreWaits`: a lookup that waits, bounded, for pages another engine is still storing — the
decode instance of a prefill/decode pair asking for a prompt whose prefill's store has not
landed in L2 yet (`KeyLookup.wait_stored_s`, the vLLM connector's `store_wait_s`).

A lookup's hit stops at the first page the index lacks; when a store plan in flight is
writing that page (`cache/writing.py`: its key is pending in the planner), the prefix
continues there. Such a lookup is answered later (a `Later`, never on the event loop's
critical path): it awaits the store's end (`Stores.until_settled`, woken when any store plan
commits or aborts), looks up again, and repeats while the next page is still being written —
until no store writes it, the bound passes, or the sidecar drains. Only the waiting op's own
task waits: the loop serves everything else meanwhile.

Lifecycle of one wait (its outcome counted once, in `/v1/stats` "store_waits"):
    not waiting   the hit ends where no store is writing (no wait, not counted)
    waiting       the next page is pending; awaiting a store's end, the bound, or the drain
    -> hit        no store writes past the hit any more and the hit grew
    -> missed     no store writes past it and the hit did not grow (the store failed or was
                  aborted: its engine died, its copy failed, L2 was full)
    -> timed_out  the bound passed with the next page still pending (answered with the hit
                  as it is then: the engine recomputes the rest)
    -> drained    the sidecar began draining (SIGTERM): answered at once with the hit now
The caller's own cancellation (its connection gone) ends a wait uncounted; nothing is held
by a wait (no pins, no reservation), so no path leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hicache.cache import TieredCache
from hicache.cache.writing import writing_after
from hicache.index import Hit, PageKey

OUTCOMES = ("hit", "missed", "timed_out", "drained")


@dataclass
class StoreWaitStats:
    waits: int = 0  # lookups that found pages a store in flight was writing, and waited
    hit: int = 0
    missed: int = 0
    timed_out: int = 0
    drained: int = 0
    waiting: int = 0  # waits in progress now
    waited_s: float = 0.0  # seconds waited, all waits together


class StoreWaits:
    def __init__(self) -> None:
        self.stats = StoreWaitStats()
        self._stopping = asyncio.Event()

    def writing(self, cache: TieredCache, keys: Mapping[str, Sequence[PageKey]], hit: Hit) -> bool:
        """Does the prompt continue past `hit` into a page a store in flight is writing?"""
        return not self._stopping.is_set() and bool(writing_after(cache.planner, keys, hit))

    def stop(self) -> None:
        """The drain began: every wait answers now, and no new one starts."""
        self._stopping.set()

    async def wait(
        self, cache: TieredCache, keys: Mapping[str, Sequence[PageKey]], wait_s: float
    ) -> tuple[Hit, str | None]:
        """The hit once no store writes the page past it, within `wait_s`; and the wait's
        outcome (None: nothing was being written, no wait)."""
        loop = asyncio.get_running_loop()
        hit = cache.lookup_keys(keys)
        waits = writing_after(cache.planner, keys, hit)
        if not waits or wait_s <= 0 or self._stopping.is_set():
            return hit, None
        stats = self.stats
        stats.waits += 1
        stats.waiting += 1
        started = loop.time()
        deadline = started + wait_s
        before = hit.pages_total
        try:
            while waits and not self._stopping.is_set() and loop.time() < deadline:
                await self._one_store(cache, waits, deadline - loop.time())
                hit = cache.lookup_keys(keys)
                waits = writing_after(cache.planner, keys, hit)
        finally:
            stats.waiting -= 1
            stats.waited_s += loop.time() - started
        if not waits:
            outcome = "hit" if hit.pages_total > before else "missed"
        else:
            outcome = "drained" if self._stopping.is_set() else "timed_out"
        setattr(stats, outcome, getattr(stats, outcome) + 1)
        return hit, outcome

    async def _one_store(
        self, cache: TieredCache, waits: Mapping[str, frozenset[PageKey]], left_s: float
    ) -> None:
        """Until the stores writing `waits` ended, the drain began, or `left_s` passed."""
        settled = asyncio.ensure_future(cache.stores.until_settled(waits))
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait(
                {settled, stopping}, timeout=max(0.0, left_s), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for task in (settled, stopping):
                task.cancel()
            for task in (settled, stopping):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
