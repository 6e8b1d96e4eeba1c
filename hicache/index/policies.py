"""Write and prefetch policies, as strategies chosen by name (the registries feed config).

Write policies decide when an L2 page is persisted to L3:
- `write_through`: every stored page, right after it reaches L2;
- `write_through_selective`: a page once it has been hit `min_hits` times;
- `write_back`: only when it is evicted from L2 (so nothing is lost that was ever hit).
Prefetch policies decide how long a load waits for L3 -> L2 prefetches:
- `best_effort`: not at all — what is in L2 is loaded, the rest recomputed;
- `wait_complete`: until every prefetch finished;
- `timeout`: a deadline. Fixed (`base_s` a number of seconds): `base_s + per_token_s *
  tokens`. Auto (`base_s="auto"`, the deployment's default): the time the hit's L3-only
  bytes (behind the reads already in flight) take at L3's measured read rate, times
  `headroom`, plus `floor_s`, at most `max_s` — so a load waits for an L3 that is merely
  slow, and a hanging one costs it at most `max_s` (a down one nothing: its breaker answers
  at once). Before any read was measured the rate is `AUTO_START_BYTES_PER_S`.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Literal

from hicache.index.prefix_index import PageRecord

# the read rate an auto deadline assumes before L3 was measured: the slowest L3 the guarded
# store tolerates before it times a call out (`GuardedStore(min_bandwidth_bytes_per_s=50e6)`)
AUTO_START_BYTES_PER_S = 50e6


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
    def wait_s(
        self, tokens: int, l3_bytes: int = 0, read_bytes_per_s: float | None = None
    ) -> float | None:
        """How long a load may wait for prefetches of `tokens` tokens, L3 having `l3_bytes`
        bytes to read before they are done (theirs, and the reads' in flight ahead of them)
        at `read_bytes_per_s` lately (None: not measured yet): 0 (do not wait), a deadline
        in seconds, or None (wait until complete)."""


class BestEffort(PrefetchPolicy):
    name = "best_effort"

    def wait_s(
        self, tokens: int, l3_bytes: int = 0, read_bytes_per_s: float | None = None
    ) -> float | None:
        return 0.0


class WaitComplete(PrefetchPolicy):
    name = "wait_complete"

    def wait_s(
        self, tokens: int, l3_bytes: int = 0, read_bytes_per_s: float | None = None
    ) -> float | None:
        return None


def _check(name: str, value: object, low: float, inclusive: bool, extra: str = "") -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < low
        or (value == low and not inclusive)
    ):
        bound = f">= {low}" if inclusive else f"> {low}"
        raise ValueError(
            f"timeout prefetch policy: {name}={value!r}; must be a number {bound}{extra}"
        )


@dataclass
class Timeout(PrefetchPolicy):
    base_s: float | Literal["auto"] = 0.002  # a number: fixed; "auto": from L3's read rate
    per_token_s: float = 2e-6  # fixed deadlines only
    headroom: float = 2.0  # auto: times the expected read time
    floor_s: float = 0.01  # auto: at least (a small read's latency, the loop's jitter)
    max_s: float = 1.0  # auto: at most (what a hanging L3 costs a load)
    name = "timeout"

    def __post_init__(self) -> None:
        if self.base_s != "auto":
            _check("base_s", self.base_s, 0.0, inclusive=True, extra=" or 'auto'")
        _check("per_token_s", self.per_token_s, 0.0, inclusive=True)
        _check("headroom", self.headroom, 0.0, inclusive=False)
        _check("floor_s", self.floor_s, 0.0, inclusive=True)
        _check("max_s", self.max_s, 0.0, inclusive=False)
        if self.floor_s > self.max_s:
            raise ValueError(
                f"timeout prefetch policy: floor_s={self.floor_s!r} is above "
                f"max_s={self.max_s!r}; the floor must be <= the cap"
            )

    def wait_s(
        self, tokens: int, l3_bytes: int = 0, read_bytes_per_s: float | None = None
    ) -> float | None:
        if self.base_s != "auto":
            return self.base_s + self.per_token_s * tokens
        rate = read_bytes_per_s if read_bytes_per_s else AUTO_START_BYTES_PER_S
        return min(self.max_s, self.floor_s + self.headroom * l3_bytes / rate)


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


def prefetch_policy(
    name: str,
    *,
    timeout_s: float | Literal["auto"] = "auto",
    per_token_s: float = 2e-6,
    headroom: float = 2.0,
    floor_s: float = 0.01,
    max_s: float = 1.0,
) -> PrefetchPolicy:
    """The prefetch policy `name` (the `cache` section's settings shape `timeout` only)."""
    if name not in PREFETCH_POLICIES:
        raise ValueError(
            f"prefetch_policy {name!r} is not known; allowed: {', '.join(PREFETCH_POLICIES)}"
        )
    if name == Timeout.name:
        return Timeout(timeout_s, per_token_s, headroom, floor_s, max_s)
    return PREFETCH_POLICIES[name]()
