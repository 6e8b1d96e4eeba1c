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
    -> abandoned  the waiting engine's connection is gone (`Session.gone`; not by the drain):
                  no one reads the answer, so the wait ends at once and its session ends
                  without waiting on it
Nothing is held by a wait (no pins, no reservation), so ending it at any point leaks nothing.
The hit, and what is pending past it, are of the lookup's `groups` (all when None).

Without waiting: every lookup reply (by keys or by tokens) says whether a store in flight
writes the page past its hit (`store_writing`, from `writing` / `writing_tokens`: the same
`writing_after` the wait uses; False once the drain began). An engine that can ask again
later (vLLM's connector: `KeyLookup.answer_at_once`) waits on its own side, asking at its
next steps, and counts the outcomes itself; the sidecar holds nothing for it and counts each
reply that said a store was writing (`answered_writing`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hicache.cache import TieredCache
from hicache.cache.writing import pending_pages, until_first, writing_after
from hicache.index import Hit, PageKey

OUTCOMES = ("hit", "missed", "timed_out", "drained", "abandoned")


@dataclass
class StoreWaitStats:
    waits: int = 0  # lookups that found pages a store in flight was writing, and waited
    hit: int = 0
    missed: int = 0
    timed_out: int = 0
    drained: int = 0
    abandoned: int = 0
    waiting: int = 0  # waits in progress now
    waited_s: float = 0.0  # seconds waited, all waits together
    # lookup replies saying a store in flight writes the page past their hit (`store_writing`:
    # an engine asking again later, or a wait that timed out)
    answered_writing: int = 0


class StoreWaits:
    def __init__(self) -> None:
        self.stats = StoreWaitStats()
        self.stopping = asyncio.Event()  # the drain began (`stop`)

    def writing(self, cache: TieredCache, keys: Mapping[str, Sequence[PageKey]], hit: Hit) -> bool:
        """Does the prompt continue past `hit` (of `keys`' groups) into a page a store in
        flight is writing?"""
        return not self.stopping.is_set() and bool(writing_after(cache.planner, keys, hit))

    def writing_tokens(self, cache: TieredCache, tokens: Sequence[int], hit: Hit) -> bool:
        """`writing` of a lookup by tokens: the prompt keyed only up to the page past the
        hit, and only while some store plan is in flight."""
        if self.stopping.is_set() or not pending_pages(cache.planner):
            return False
        page = hit.page_size_tokens
        keys = cache.index.keys(tokens[: (hit.pages_total + 1) * page])
        return bool(writing_after(cache.planner, keys, hit))

    def stop(self) -> None:
        """The drain began: every wait answers now, and no new one starts."""
        self.stopping.set()

    async def wait(
        self,
        cache: TieredCache,
        keys: Mapping[str, Sequence[PageKey]],
        wait_s: float,
        gone: asyncio.Event,
        groups: Sequence[str] | None = None,
    ) -> tuple[Hit, str | None]:
        """The hit (of `groups`, all when None) once no store writes the page past it,
        within `wait_s`, unless the drain began or `gone` (the asking engine's connection)
        is set; and the wait's outcome (None: nothing was being written, no wait)."""
        loop = asyncio.get_running_loop()
        named = {g: k for g, k in keys.items() if groups is None or g in groups}
        hit = cache.lookup_keys(keys, groups)
        waits = writing_after(cache.planner, named, hit)
        if not waits or wait_s <= 0 or self.stopping.is_set() or gone.is_set():
            return hit, None
        stats = self.stats
        stats.waits += 1
        stats.waiting += 1
        started = loop.time()
        deadline = started + wait_s
        before = hit.pages_total
        try:
            while (
                waits
                and not self.stopping.is_set()
                and not gone.is_set()
                and loop.time() < deadline
            ):
                await until_first(
                    [cache.stores.until_settled(waits), self.stopping.wait(), gone.wait()],
                    deadline - loop.time(),
                )
                hit = cache.lookup_keys(keys, groups)
                waits = writing_after(cache.planner, named, hit)
        finally:
            stats.waiting -= 1
            stats.waited_s += loop.time() - started
        if not waits:
            outcome = "hit" if hit.pages_total > before else "missed"
        elif self.stopping.is_set():  # the drain (which then drops every connection)
            outcome = "drained"
        else:
            outcome = "abandoned" if gone.is_set() else "timed_out"
        setattr(stats, outcome, getattr(stats, outcome) + 1)
        return hit, outcome
