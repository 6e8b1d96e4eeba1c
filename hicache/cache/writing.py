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
write policy) and written behind the acknowledgement; this waits, bounded, polling every
`_PERSIST_POLL_S` on the loop (never blocking it), while some page L3 lacks is still owed
(queued, or a batch is being written): True once L3 holds every page of the prompt, False
at the bound or once nothing owed is left (dropped, failed, evicted, not offered: a
write-back policy, no L3)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from hicache.cache.persist import PersistQueue
from hicache.cache.planner import Planner
from hicache.index import Hit, PageKey, PrefixIndex

_PERSIST_POLL_S = 0.01


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
    """Pages store plans in flight are writing now, across groups."""
    return sum(len(keys) for keys in planner.pending.values())


async def until_persisted(
    index: PrefixIndex,
    persist: PersistQueue,
    keys: Mapping[str, Sequence[PageKey]],
    timeout_s: float,
) -> bool:
    """Within `timeout_s`, until L3 holds every page of `keys` (True), or no page it lacks
    is owed any more (False)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        missing = []
        for group, group_keys in keys.items():
            for key in group_keys:
                record = index.record(group, key)
                if record is None:
                    return False  # not stored (L2 full), or gone from the index
                if not record.in_l3:
                    missing.append((group, record))
        if not missing:
            return True
        owed = persist.writing or any(persist.waiting(g, r) for g, r in missing)
        if not owed or loop.time() >= deadline:
            return False
        await asyncio.sleep(_PERSIST_POLL_S)
