"""Write and prefetch policies, as strategies chosen by name (the registries feed config).

Write policies decide when an L2 page is persisted to L3:
- `write_through`: every stored page, right after it reaches L2;
- `write_through_selective`: a page once it has been hit `min_hits` times;
- `write_back`: only when it is evicted from L2 (so nothing is lost that was ever hit).
Prefetch policies decide how long a load waits for L3 -> L2 prefetches:
- `best_effort`: not at all — what is in L2 is loaded, the rest recomputed;
- `wait_complete`: until every prefetch finished;
- `timeout`: `base_s + per_token_s * tokens` (the deadline grows with the tokens asked for).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from hicache.index.prefix_index import PageRecord


class WritePolicy(abc.ABC):
    name: str

    def on_store(self, record: PageRecord) -> bool:
        """Persist now, when the page has just reached L2?"""
        return False

    def on_hit(self, record: PageRecord) -> bool:
        """Persist now, after a lookup hit the page (record.hits already counts it)?"""
        return False

    def on_evict(self, record: PageRecord) -> bool:
        """Persist before the page leaves L2?"""
        return False


class WriteThrough(WritePolicy):
    name = "write_through"

    def on_store(self, record: PageRecord) -> bool:
        return not record.in_l3


@dataclass
class WriteThroughSelective(WritePolicy):
    min_hits: int = 2
    name = "write_through_selective"

    def on_hit(self, record: PageRecord) -> bool:
        return not record.in_l3 and record.hits >= self.min_hits


class WriteBack(WritePolicy):
    name = "write_back"

    def on_evict(self, record: PageRecord) -> bool:
        return not record.in_l3


class PrefetchPolicy(abc.ABC):
    name: str

    @abc.abstractmethod
    def wait_s(self, tokens: int) -> float | None:
        """How long a load may wait for prefetches of `tokens` tokens: 0 (do not wait), a
        deadline in seconds, or None (wait until complete)."""


class BestEffort(PrefetchPolicy):
    name = "best_effort"

    def wait_s(self, tokens: int) -> float | None:
        return 0.0


class WaitComplete(PrefetchPolicy):
    name = "wait_complete"

    def wait_s(self, tokens: int) -> float | None:
        return None


@dataclass
class Timeout(PrefetchPolicy):
    base_s: float = 0.002
    per_token_s: float = 2e-6
    name = "timeout"

    def wait_s(self, tokens: int) -> float | None:
        return self.base_s + self.per_token_s * tokens


WRITE_POLICIES: dict[str, type[WritePolicy]] = {
    "write_through": WriteThrough,
    "write_through_selective": WriteThroughSelective,
    "write_back": WriteBack,
}
PREFETCH_POLICIES: dict[str, type[PrefetchPolicy]] = {
    "best_effort": BestEffort,
    "wait_complete": WaitComplete,
    "timeout": Timeout,
}
