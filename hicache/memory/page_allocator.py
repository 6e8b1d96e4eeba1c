"""`PageAllocator`: page ids of one pool, handed out as contiguous runs where possible, with
pin counts. A pinned page is in flight (or being read) and can be neither freed nor reused.

Lifecycle: alloc(n) -> pin(pages) -> [copy] -> unpin(pages) -> ... -> free(pages). Allocation is
all-or-nothing: a request it cannot meet raises `PoolExhaustedError` and changes nothing.
Contiguous runs matter: a run is one gather or scatter at memcpy speed (see docs/design.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hicache.errors import PinError, PoolExhaustedError


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    num_pages: int
    free_pages: int
    pinned_pages: int


class PageAllocator:
    def __init__(self, num_pages: int, name: str = "pool"):
        if num_pages < 1:
            raise PoolExhaustedError(f"{name}: a pool needs at least 1 page; got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        self._free_extents: dict[int, int] = {0: num_pages}  # start -> length
        self._extent_ending: dict[int, int] = {num_pages: 0}  # end -> start
        self._free_count = num_pages
        self._pins: dict[int, int] = {}
        self._used: set[int] = set()

    # ---- allocation -------------------------------------------------------------------

    def alloc(self, count: int) -> list[int]:
        if count < 0:
            raise ValueError(f"{self.name}: cannot allocate {count} pages")
        if count > self._free_count:
            raise PoolExhaustedError(
                f"{self.name}: {count} pages asked for, {self._free_count} of "
                f"{self.num_pages} free (the others hold data or are pinned by copies in "
                "flight); free or evict pages, or raise the pool's capacity"
            )
        pages: list[int] = []
        # first fit for one run; otherwise take the largest runs first
        fit = min(
            (start for start, length in self._free_extents.items() if length >= count),
            default=None,
        )
        if fit is not None:
            pages.extend(self._take(fit, count))
        else:
            for start in sorted(self._free_extents, key=lambda s: -self._free_extents[s]):
                need = count - len(pages)
                if need == 0:
                    break
                pages.extend(self._take(start, min(need, self._free_extents[start])))
        self._used.update(pages)
        return pages

    def _take(self, start: int, count: int) -> range:
        length = self._free_extents.pop(start)
        del self._extent_ending[start + length]
        if length > count:
            self._free_extents[start + count] = length - count
            self._extent_ending[start + length] = start + count
        self._free_count -= count
        return range(start, start + count)

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        for page in pages:
            if page not in self._used:
                raise PinError(f"{self.name}: page {page} is not allocated; it cannot be freed")
            if self._pins.get(page):
                raise PinError(
                    f"{self.name}: page {page} is pinned ({self._pins[page]} in flight); "
                    "unpin it before freeing"
                )
        if len(set(pages)) != len(pages):
            raise PinError(f"{self.name}: a page is listed twice in one free")
        for page in pages:
            self._used.discard(page)
            self._give_back(page)

    def _give_back(self, page: int) -> None:
        start, length = page, 1
        if page in self._extent_ending:  # merge with the run ending here
            start = self._extent_ending.pop(page)
            length += self._free_extents.pop(start)
        end = start + length
        if end in self._free_extents:  # merge with the run starting after
            after = self._free_extents.pop(end)
            del self._extent_ending[end + after]
            length += after
        self._free_extents[start] = length
        self._extent_ending[start + length] = start
        self._free_count += 1

    # ---- pins ---------------------------------------------------------------------------

    def pin(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        for page in pages:
            if page not in self._used:
                raise PinError(f"{self.name}: page {page} is not allocated; it cannot be pinned")
        for page in pages:
            self._pins[page] = self._pins.get(page, 0) + 1

    def unpin(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        counts: dict[int, int] = {}
        for page in pages:
            counts[page] = counts.get(page, 0) + 1
        for page, count in counts.items():
            if self._pins.get(page, 0) < count:
                raise PinError(f"{self.name}: page {page} is not pinned; unpin without a pin")
        for page, count in counts.items():
            left = self._pins[page] - count
            if left:
                self._pins[page] = left
            else:
                del self._pins[page]

    def is_allocated(self, page: int) -> bool:
        return page in self._used

    def is_pinned(self, page: int) -> bool:
        """A copy still reads or writes it: it can be neither freed nor reused."""
        return page in self._pins

    def stats(self) -> AllocatorStats:
        return AllocatorStats(self.num_pages, self._free_count, len(self._pins))

    def check(self) -> None:
        """Invariants, for tests: extents disjoint, counts consistent, pins only on used."""
        covered = 0
        last_end = -1
        for start in sorted(self._free_extents):
            length = self._free_extents[start]
            assert start > last_end, "free extents overlap or touch without merging"
            assert self._extent_ending[start + length] == start
            assert not any(start <= p < start + length for p in self._used)
            covered += length
            last_end = start + length
        assert covered == self._free_count == self.num_pages - len(self._used)
        assert all(p in self._used for p in self._pins)
