"""`AbsentKeys`: the page keys L3 said it lacks, for a few seconds, so that asking again waits.

An engine asks about the same cold prompt many times (a scheduler matches the prefix of every
waiting request at every step until it is admitted), and each lookup of pages the index does
not know would otherwise cost an L3 round trip (`TieredCache.discover`). An answer "absent"
is remembered for `ttl_s`; another process that persists the page meanwhile is seen once the
entry expires (at worst a recompute, never a wrong page). Bounded: past `max_keys` the oldest
answers go first. Lifecycle: created with the cache; `add` after each L3 answer; `fresh`
on every lookup; entries expire by themselves.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from hicache.index.keys import PageKey

GroupKey = tuple[str, PageKey]


class AbsentKeys:
    def __init__(
        self, ttl_s: float, max_keys: int = 65_536, clock: Callable[[], float] = time.monotonic
    ):
        if ttl_s < 0 or max_keys < 1:
            raise ValueError(
                f"absent keys: ttl_s is {ttl_s} and max_keys {max_keys}; ttl_s must be >= 0 "
                "and max_keys >= 1"
            )
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._expiry: OrderedDict[GroupKey, float] = OrderedDict()  # oldest answer first
        self.skipped = 0  # keys not asked about again because an answer was fresh
        # keys asked about again although an answer was fresh: a lookup that waits for
        # another engine's pages (a decode instance, which may overtake its prefill's
        # persist on another host) never trusts an earlier "absent"
        self.asked_again = 0

    def fresh(self, group: str, key: PageKey) -> bool:
        """Did L3 say it lacks this page less than `ttl_s` ago?"""
        expiry = self._expiry.get((group, key))
        if expiry is None:
            return False
        if expiry <= self._clock():
            del self._expiry[(group, key)]
            return False
        return True

    def add(self, keys: Iterable[GroupKey]) -> None:
        if self.ttl_s == 0:
            return
        expiry = self._clock() + self.ttl_s
        for entry in keys:
            self._expiry[entry] = expiry
            self._expiry.move_to_end(entry)
        while len(self._expiry) > self.max_keys:
            self._expiry.popitem(last=False)

    def __len__(self) -> int:
        return len(self._expiry)
