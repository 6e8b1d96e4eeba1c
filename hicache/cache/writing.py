"""Pages stores in flight are writing: what a lookup needs to wait for a store that has not
landed yet (the consumer of a prefill/decode pair, `service/store_waits.py`); and
`until_persisted`, a store acknowledged only once L3 holds its pages (the producer of a pair
on another host, which sees the pages through L3 only).

A store plan marks its keys pending in the planner from its plan to its commit or abort
(`planner.py`); a lookup's hit stops at the first page the index lacks. When that page is
pending, the prefix continues into a store in flight: waiting for it (`Stores.until_settled`,
woken by the planner's `store_ended` hook) turns a miss into a hit. Pure reads of the
planner, no awaits.

`until_persisted`: a store's pages are offered to the persist queue at its commit (per the
write policy) and written behind the acknowledgement; this waits, bounded, while some page L3
lacks is still owed (queued, or a batch is being written). Lifecycle of one persist wait:
    checking   the pages a decode needs (`GroupRule.needed`) looked up once: a page with no
               record -> False (not stored: L2 full, or gone); none lacking L3 -> True
    waiting    for the persist queue's next change (a batch ended, pages withdrawn or
               dropped at a detach: `PersistQueue.next_change`), the bound, or a stop
               (the connection gone: no one reads the reply; the drain began)
    -> True    every page is in L3 (only the pages still lacking are looked at again)
    -> False   nothing owed is left (dropped, failed, evicted, not offered: a write-back
               policy, no L3), the bound passed, or a stop
Nothing is held meanwhile (no pin, no plan: the store committed), so ending it early leaks
nothing; the loop is never polled on a timer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any

from hicache.cache.persist import PersistQueue
from hicache.cache.planner import Planner
from hicache.index import Hit, PageKey, PrefixIndex


def writing_after(
    planner: Planner, keys: Mapping[str, Sequence[PageKey]], hit: Hit
) -> dict[str, frozenset[PageKey]]:
    """Per group, the prompt's first page past `hit` when a store in flight is writing it
    (empty: the hit ends where no store is writing)."""
    page = hit.pages_total
    return {
        group: frozenset((group_keys[page],))
        for group, group_keys in keys.items()
        if page < len(group_keys) and group_keys[page] in planner.pending.get(group, ())
    }


def pending_pages(planner: Planner) -> int:
    """Pages being written into L2 now, across groups: by store plans in flight, and by
    L3 -> L2 fetches (both mark their keys pending in the planner; `stores_writing_pages`
    counts both)."""
    return sum(len(keys) for keys in planner.pending.values())


async def until_first(waits: Iterable[Awaitable[Any]], timeout_s: float) -> None:
    """Until the first of `waits` completes or `timeout_s` passes; the others cancelled (and
    awaited: none is left running)."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        if tasks:  # wait, not `await task`: a cancel of this caller is never swallowed
            await asyncio.wait(tasks)
        for task in tasks:
            if not task.cancelled():
                task.result()  # a wait that failed raises here


async def until_persisted(
    index: PrefixIndex,
    persist: PersistQueue,
    keys: Mapping[str, Sequence[PageKey]],
    timeout_s: float,
    stops: Sequence[asyncio.Event] = (),
) -> bool:
    """Within `timeout_s`, until L3 holds every page of `keys` a decode needs (True), or no
    page it lacks is owed any more, or one of `stops` is set (False)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    page = index.page_size_tokens
    lacking = [
        (group, group_keys[i])
        for group, group_keys in keys.items()
        for i in index.rules[group].needed(len(group_keys), page)
    ]
    while True:
        missing = []
        for group, key in lacking:
            record = index.record(group, key)
            if record is None:
                return False  # not stored (L2 full), or gone from the index
            if not record.in_l3:
                missing.append((group, key, record))
        if not missing:
            return True
        lacking = [(group, key) for group, key, _ in missing]
        owed = persist.writing or any(persist.waiting(g, r) for g, _, r in missing)
        if not owed or loop.time() >= deadline or any(stop.is_set() for stop in stops):
            return False
        # the change is taken before awaiting: a batch ending meanwhile still wakes this
        await until_first(
            [persist.next_change(), *(stop.wait() for stop in stops)], deadline - loop.time()
        )
