"""Eviction strategies, chosen by name from `EVICTION_POLICIES` (which also feeds config
validation). Each tracks keys in its own order and proposes victims; the index decides: a
pinned key is never evicted (`can_evict` says no, and the strategy keeps it).

- `lru`: least recently used first.
- `s3fifo`: S3-FIFO (Yang et al., SOSP'23) — a small FIFO for new keys (10%), a main FIFO for
  keys seen again, and a ghost set of recently evicted small-queue keys; scan-resistant: a
  one-pass scan of new keys cannot flush the keys that are used again.
"""

from __future__ import annotations

import abc
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable


class EvictionPolicy(abc.ABC):
    @abc.abstractmethod
    def insert(self, key: Hashable) -> None: ...

    @abc.abstractmethod
    def touch(self, key: Hashable) -> None: ...

    @abc.abstractmethod
    def remove(self, key: Hashable) -> None: ...

    @abc.abstractmethod
    def victims(self, count: int, can_evict: Callable[[Hashable], bool]) -> list[Hashable]:
        """Up to `count` keys to evict, none of which `can_evict` refuses; they stay tracked
        until the caller `remove`s them."""

    @abc.abstractmethod
    def __len__(self) -> int: ...


class LruPolicy(EvictionPolicy):
    def __init__(self, capacity: int = 0):
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self, count: int, can_evict: Callable[[Hashable], bool]) -> list[Hashable]:
        out: list[Hashable] = []
        for key in self._order:
            if len(out) >= count:
                break
            if can_evict(key):
                out.append(key)
        return out

    def __len__(self) -> int:
        return len(self._order)


class S3FifoPolicy(EvictionPolicy):
    def __init__(self, capacity: int):
        self._small_limit = max(1, capacity // 10)
        self._ghost_limit = max(1, capacity)
        self._small: deque[Hashable] = deque()
        self._main: deque[Hashable] = deque()
        self._where: dict[Hashable, str] = {}
        self._freq: dict[Hashable, int] = {}
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        if key in self._where:
            self.touch(key)
            return
        queue = "main" if key in self._ghost else "small"
        self._ghost.pop(key, None)
        (self._main if queue == "main" else self._small).append(key)
        self._where[key] = queue
        self._freq[key] = 0

    def touch(self, key: Hashable) -> None:
        if key in self._freq:
            self._freq[key] = min(3, self._freq[key] + 1)

    def remove(self, key: Hashable) -> None:
        queue = self._where.pop(key, None)
        if queue is None:
            return
        (self._small if queue == "small" else self._main).remove(key)
        if queue == "small":
            self._ghost[key] = None
            while len(self._ghost) > self._ghost_limit:
                self._ghost.popitem(last=False)
        del self._freq[key]

    def victims(self, count: int, can_evict: Callable[[Hashable], bool]) -> list[Hashable]:
        """Walk the queues as S3-FIFO would, promoting and aging as it goes; keys that may not
        be evicted (pinned) rotate to their queue's tail."""
        out: list[Hashable] = []
        budget = 4 * (len(self._small) + len(self._main)) + 4  # every key is aged at most 3x
        while len(out) < count and budget > 0 and (self._small or self._main):
            budget -= 1
            from_small = bool(self._small) and (
                len(self._small) >= self._small_limit or not self._main
            )
            queue = self._small if from_small else self._main
            key = queue.popleft()
            if key in out:
                queue.append(key)
                continue
            if from_small and self._freq[key] > 0:
                self._freq[key] = 0
                self._main.append(key)
                self._where[key] = "main"
            elif not from_small and self._freq[key] > 0:
                self._freq[key] -= 1
                self._main.append(key)
            else:
                queue.append(key)  # stays tracked until the caller removes it
                if can_evict(key):
                    out.append(key)
        return out

    def __len__(self) -> int:
        return len(self._where)


EVICTION_POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LruPolicy,
    "s3fifo": S3FifoPolicy,
}
