"""Pages stores in flight are writing: what a lookup needs to wait for a store that has not
landed yet (the consumer of a prefill/decode pair, `service/store_waits.py`).

A store plan marks its keys pending in the planner from its plan to its commit or abort
(`planner.py`); a lookup's hit stops at the first page the index lacks. When that page is
pending, the prefix continues into a store in flight: waiting for it (`Stores.until_settled`,
woken by the planner's `store_ended` hook) turns a miss into a hit. Pure reads of the
planner, no awaits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hicache.cache.planner import Planner
from hicache.index import Hit, PageKey


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
