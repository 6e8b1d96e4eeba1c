"""`PrefixIndex`: for every page key of every cache group, where the page lives (an L2 host
page, L3 presence), its pins and hits; and `lookup`, which answers how many tokens of a
prompt each tier can serve, counting only hits every group can use.

What a group needs to serve a prefix of h pages (`GroupRule.needed`):
- full / sparse (and MLA) groups: pages 0..h-1;
- sliding groups (window W): the pages holding tokens [h*P - W, h*P);
- chunked groups (chunk C): the pages of the current chunk, tokens [floor(h*P / C)*C, h*P);
- state groups (linear / mamba / conv): the snapshot stored at boundary h, keyed by the
  group's key of page h-1.
The usable hit is the largest h all groups can serve — it is not monotone for sliding and
state groups, so every h is checked from the longest down (whole-prefix groups first bound it
by their longest present run). `lookup_keys` answers the same for a prompt given by its keys
(an engine computes them once, `PackedKeys` carries them packed): nothing is rehashed. Every
page of a whole-prefix run is checked, exactly; the cost per page is kept in C: the index keeps
the set of keys with an L2 copy beside the records (changed only where an `l2_page` is, in
`insert_l2` and `drop_l2`), so a run L2 holds whole is one `issuperset`, and only pages L3
alone holds are checked one by one (128k tokens, 8192 pages: ~0.3 ms, from ~5 ms hashing
and walking them in Python). Lifecycle of a page: `insert_l2`
(after a backup is acknowledged) -> `mark_l3` (after a persist) -> `l2_victims` / `drop_l2`
under pressure (pinned pages are never proposed) -> `drop_l3` when storage evicts it.
Records of pages only L3 holds are bounded (`l3_only_max_pages` per group, least recently
marked or hit forgotten first): storage evicts on its own and never tells us, so without a
bound the index would grow with every page ever persisted. A forgotten page is not lost: the
lookup of a prompt whose pages the index does not know asks L3 (`TieredCache.discover`).
No torch here; the scheduler moves the bytes, this only keeps the books.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from hicache.errors import HicacheError, PinError
from hicache.index.eviction import EVICTION_POLICIES, EvictionPolicy
from hicache.index.keys import PageKey, PageKeyer
from hicache.index.watch import NO_WATCHER, IndexWatcher
from hicache.model import CacheGroup, CacheKind


class PageIndexError(HicacheError, ValueError):
    """A page key was used against the index's bookkeeping (unknown, or over capacity)."""


@dataclass(frozen=True, slots=True)
class GroupRule:
    kind: CacheKind
    window_tokens: int | None = None
    chunk_tokens: int | None = None

    @classmethod
    def of(cls, group: CacheGroup) -> GroupRule:
        return cls(group.kind, group.spec.window_tokens, group.spec.chunk_tokens)

    @property
    def needs_whole_prefix(self) -> bool:
        """Every page of a prefix is needed to serve it (full attention, MLA, sparse)."""
        if not self.kind.is_token_cache:
            return False
        if self.kind is CacheKind.SLIDING and self.window_tokens is not None:
            return False
        return not (self.kind is CacheKind.CHUNKED and self.chunk_tokens is not None)

    def needed(self, pages: int, page_size_tokens: int) -> range:
        """Page positions this group needs to serve a prefix of `pages` pages."""
        if pages == 0:
            return range(0)
        if not self.kind.is_token_cache:
            return range(pages - 1, pages)
        tokens = pages * page_size_tokens
        first_token = 0
        if self.kind is CacheKind.SLIDING and self.window_tokens is not None:
            first_token = max(0, tokens - self.window_tokens)
        elif self.kind is CacheKind.CHUNKED and self.chunk_tokens is not None:
            first_token = (tokens // self.chunk_tokens) * self.chunk_tokens
        return range(first_token // page_size_tokens, pages)


@dataclass(slots=True)
class PageRecord:
    key: PageKey
    l2_page: int | None = None
    in_l3: bool = False
    pins: int = 0
    hits: int = 0
    used: int = 0  # when last inserted into L2 or hit, on `USE_CLOCK` (one order across indexes)


# one clock for every index of the process, so tenants sharing an L2 compare recency
# (`cache.shares`: the least recently used page among several indexes' victims)
USE_CLOCK = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Hit:
    """How much of a prompt the tiers can serve, in pages and tokens; `needed` lists, per
    group, the page positions (with their records) a load of `pages_total` must move."""

    page_size_tokens: int
    pages_l2: int
    pages_total: int
    needed: Mapping[str, tuple[tuple[int, PageRecord], ...]] = field(default_factory=dict)
    # for a load: page positions the L2+L3 hit needed that could not be brought to L2
    failed: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def tokens_l2(self) -> int:
        return self.pages_l2 * self.page_size_tokens

    @property
    def tokens_total(self) -> int:
        return self.pages_total * self.page_size_tokens


@dataclass(frozen=True, slots=True)
class Served:
    """The pages of a prompt one group holds, as prefix lengths: 1..`run`, and those in `at`."""

    run: int
    at: tuple[int, ...]

    def lengths(self, limit: int) -> list[int]:
        """Every length up to `limit` held, ascending."""
        return sorted({*range(1, min(self.run, limit) + 1), *(h for h in self.at if h <= limit)})


class PrefixIndex:
    def __init__(
        self,
        keyers: Mapping[str, PageKeyer],
        rules: Mapping[str, GroupRule],
        l2_capacity_pages: Mapping[str, int],
        page_size_tokens: int,
        eviction: str = "lru",
        l3_only_max_pages: int = 262_144,
    ):
        if l3_only_max_pages < 1:
            raise PageIndexError(f"l3_only_max_pages is {l3_only_max_pages}; it must be >= 1")
        if set(keyers) != set(rules) or set(rules) != set(l2_capacity_pages):
            raise PageIndexError(
                f"keyers {sorted(keyers)}, rules {sorted(rules)} and capacities "
                f"{sorted(l2_capacity_pages)} must name the same groups"
            )
        if eviction not in EVICTION_POLICIES:
            raise PageIndexError(
                f"eviction policy {eviction!r} is not known; allowed: {sorted(EVICTION_POLICIES)}"
            )
        self.keyers = dict(keyers)
        self.eviction = eviction
        self.rules = dict(rules)
        self.capacity = dict(l2_capacity_pages)
        self.page_size_tokens = page_size_tokens
        self._records: dict[str, dict[PageKey, PageRecord]] = {g: {} for g in rules}
        self._l2_count = {g: 0 for g in rules}
        # the keys with an L2 copy, beside the records (kept by insert_l2 / drop_l2, the only
        # places an l2_page changes): a lookup checks a run of them in one C-level pass
        self._l2_keys: dict[str, set[PageKey]] = {g: set() for g in rules}
        self._policies: dict[str, EvictionPolicy] = {
            g: EVICTION_POLICIES[eviction](max(1, cap)) for g, cap in self.capacity.items()
        }
        self.l3_only_max_pages = l3_only_max_pages
        # keys of records only L3 holds, least recently marked or hit first
        self._l3_only: dict[str, OrderedDict[PageKey, None]] = {g: OrderedDict() for g in rules}
        self.l3_forgotten = {g: 0 for g in rules}
        self._pinned = {g: 0 for g in rules}  # records with pins > 0
        self.watcher: IndexWatcher = NO_WATCHER  # told of every tier change (`index/watch.py`)

    # ---- lookup ---------------------------------------------------------------------------

    def keys(self, token_ids: Sequence[int]) -> dict[str, list[PageKey]]:
        """Every group's keys of the prompt's full pages (the tokens converted once)."""
        if not self.keyers:
            return {}
        data = next(iter(self.keyers.values())).token_bytes(token_ids)
        return {group: keyer.keys_of_bytes(data) for group, keyer in self.keyers.items()}

    def lookup(self, token_ids: Sequence[int], *, touch: bool = False, skip_pages: int = 0) -> Hit:
        """The hit per tier. `skip_pages`: the engine holds the prompt's first pages already
        (its own device cache); they count as served, and `needed` lists only later pages.
        A lookup changes nothing unless `touch` (engines probe waiting requests at every step:
        a probe is not a use; loads count their hits, `touch`)."""
        return self.lookup_keys(self.keys(token_ids), touch=touch, skip_pages=skip_pages)

    def lookup_keys(
        self,
        keys: Mapping[str, Sequence[PageKey]],
        *,
        touch: bool = False,
        skip_pages: int = 0,
        rows: bool = True,
        groups: Collection[str] | None = None,
    ) -> Hit:
        """`lookup` of a prompt given by its keys (every group's, as `keys` computes them: an
        engine that computed them once sends them instead of its tokens). `rows=False`: only
        the counts, no `needed` (a lookup's reply needs no records). `groups`: the hit of
        those groups alone (an engine that moves each of its pools on its own, as SGLang's
        storage backend does); default every group."""
        keys = self._of_groups(keys, groups)
        pages = min((len(k) for k in keys.values()), default=0)
        skip = min(skip_pages, pages)
        pages_l2, pages_total = self._longest(keys, pages, skip)
        needed = {}
        if rows:
            for group, group_keys in keys.items():
                records = self._records[group]
                found = tuple(
                    (i, records[group_keys[i]])
                    for i in self.rules[group].needed(pages_total, self.page_size_tokens)
                    if i >= skip
                )
                needed[group] = found
                if touch:
                    self.touch(group, [r for _, r in found])
        return Hit(self.page_size_tokens, pages_l2, pages_total, needed)

    def _of_groups(
        self, keys: Mapping[str, Sequence[PageKey]], groups: Collection[str] | None
    ) -> Mapping[str, Sequence[PageKey]]:
        """`keys` checked (every group of the index), narrowed to `groups` (None: all)."""
        if keys.keys() != self.rules.keys():
            raise PageIndexError(
                f"keys name groups {sorted(keys)}; this index keys {sorted(self.rules)}"
            )
        if groups is None:
            return keys
        unknown = sorted(set(groups) - set(self.rules))
        if unknown or not groups:
            raise PageIndexError(
                f"a lookup of groups {sorted(groups)}: name one or more of {sorted(self.rules)}"
            )
        return {group: keys[group] for group in self.rules if group in groups}

    def served(
        self, keys: Mapping[str, Sequence[PageKey]], groups: Collection[str] | None = None
    ) -> dict[str, Served]:
        """Per group (of `groups`, default all), the pages of the prompt it holds in L2 or
        L3, each as the prefix length ending with it: a whole-prefix group its leading run
        (`run`: every length up to it is served), any other group every page held (`at`: a
        state group's snapshots — the one after h pages is its page h-1 —, a sliding
        group's pages, which a window of the engine's own size then needs; not monotone).
        What SGLang's `batch_exists_v2` applies its hit policies to."""
        keys = self._of_groups(keys, groups)
        pages = min((len(k) for k in keys.values()), default=0)
        out = {}
        for group, group_keys in keys.items():
            if self.rules[group].needs_whole_prefix:
                out[group] = Served(self._present_runs(group, group_keys, pages, 0)[1], ())
                continue
            records = self._records[group]
            at = []
            for i, key in enumerate(group_keys[:pages]):
                record = records.get(key)
                if record is not None and (record.l2_page is not None or record.in_l3):
                    at.append(i + 1)
            out[group] = Served(0, tuple(at))
        return out

    def _longest(
        self, keys: Mapping[str, Sequence[PageKey]], pages: int, skip: int = 0
    ) -> tuple[int, int]:
        """The longest prefix every group can serve, from L2 and from L2 or L3. Whole-prefix
        groups bound it in one pass over their records (fetched once for both tiers); only
        the others (windows, chunks, state snapshots, whose needs are not monotonic in the
        prefix) are checked per candidate length."""
        limit_l2 = limit_total = pages
        others = []
        for group, group_keys in keys.items():
            if self.rules[group].needs_whole_prefix:
                l2, total = self._present_runs(group, group_keys, limit_total, skip)
                limit_l2, limit_total = min(limit_l2, l2), min(limit_total, total)
            else:
                others.append(group)
        return (
            self._served(keys, others, limit_l2, True, skip),
            self._served(keys, others, limit_total, False, skip),
        )

    def _served(
        self,
        keys: Mapping[str, Sequence[PageKey]],
        others: Sequence[str],
        limit: int,
        l2_only: bool,
        skip: int,
    ) -> int:
        for h in range(limit, 0, -1):
            if h <= skip or all(
                self._serves(group, keys[group], h, l2_only, skip) for group in others
            ):
                return h
        return 0

    def _present_runs(
        self, group: str, keys: Sequence[PageKey], limit: int, skip: int
    ) -> tuple[int, int]:
        """The end of the run of pages from `skip` on that L2 holds, and of the one L2 or L3
        holds, at most `limit`. Exact and C-level where it can be: a run L2 holds whole is
        one `issuperset` over the set of L2 keys (a packed blob's keys unpacked in one more
        pass); a shorter one's end is the first miss of one membership pass; only the pages
        after it that L3 alone holds are checked one by one."""
        start = min(skip, limit)
        if start >= limit:
            return limit, limit
        run = keys[start:limit]
        in_l2 = self._l2_keys[group]
        if in_l2.issuperset(run):
            return limit, limit
        l2 = list(map(in_l2.__contains__, run)).index(False)
        records = self._records[group]
        end = l2
        while end < len(run):
            record = records.get(run[end])
            if record is None or (record.l2_page is None and not record.in_l3):
                break
            end += 1
        return start + l2, start + end

    def _serves(
        self, group: str, keys: Sequence[PageKey], pages: int, l2_only: bool, skip: int = 0
    ) -> bool:
        records = self._records[group]
        for i in self.rules[group].needed(pages, self.page_size_tokens):
            if i < skip:
                continue
            record = records.get(keys[i])
            if record is None or (record.l2_page is None and (l2_only or not record.in_l3)):
                return False
        return True

    # ---- bookkeeping ----------------------------------------------------------------------

    def record(self, group: str, key: PageKey) -> PageRecord | None:
        return self._records[group].get(key)

    def insert_l2(self, group: str, key: PageKey, l2_page: int) -> PageRecord:
        records = self._records[group]
        record = records.get(key)
        if record is not None and record.l2_page is not None:
            raise PageIndexError(
                f"group {group!r}: key {key.hex()} is already in L2 (host page "
                f"{record.l2_page}); drop it before storing it again"
            )
        if self._l2_count[group] >= self.capacity[group]:
            raise PageIndexError(
                f"group {group!r}: L2 holds {self._l2_count[group]} of {self.capacity[group]} "
                "pages; evict (l2_victims + drop_l2) before inserting"
            )
        if record is None:
            record = records[key] = PageRecord(key)
        record.l2_page = l2_page
        record.used = next(USE_CLOCK)
        self._l2_count[group] += 1
        self._l2_keys[group].add(key)
        self._policies[group].insert(key)
        self._l3_only[group].pop(key, None)
        self.watcher.l2_in(group, key)
        return record

    def mark_l3(self, group: str, key: PageKey) -> PageRecord:
        return self.mark_l3_many(group, [key])[0]

    def mark_l3_many(self, group: str, keys: Sequence[PageKey]) -> list[PageRecord]:
        """L3 holds these pages (a persist acknowledged, or found by asking L3); the bound on
        L3-only records never forgets one of them to make room for another."""
        records = self._records[group]
        marked, new = [], []
        for key in keys:
            record = records.get(key)
            if record is None:
                record = records[key] = PageRecord(key)
            if not record.in_l3:
                new.append(key)
            record.in_l3 = True
            marked.append(record)
        if new:
            self.watcher.l3_in(group, new)
        self._note_l3_only(group, [r.key for r in marked if r.l2_page is None])
        return marked

    def _note_l3_only(self, group: str, keys: Sequence[PageKey]) -> None:
        """`keys` are now held by L3 alone: remember them as the most recent, and forget the
        least recent other unpinned ones beyond the bound."""
        l3_only = self._l3_only[group]
        for key in keys:
            l3_only[key] = None
            l3_only.move_to_end(key)
        excess = len(l3_only) - self.l3_only_max_pages
        if excess <= 0:
            return
        records, keep = self._records[group], set(keys)
        victims: list[PageKey] = []
        for old in l3_only:
            if len(victims) == excess:
                break
            if records[old].pins == 0 and old not in keep:
                victims.append(old)
        for old in victims:
            del l3_only[old]
            del records[old]
            self.watcher.forgotten(group, old)
        self.l3_forgotten[group] += len(victims)

    def l2_victims(
        self, group: str, count: int, can_evict: Callable[[PageRecord], bool] | None = None
    ) -> list[PageRecord]:
        """Up to `count` unpinned L2 pages to evict, in the policy's order (not yet dropped);
        `can_evict` may refuse more (pages a plan reserved, or a copy still reads)."""
        records = self._records[group]
        if can_evict is None:
            keys = self._policies[group].victims(count, lambda k: records[k].pins == 0)  # type: ignore[index]
        else:
            check = can_evict
            keys = self._policies[group].victims(
                count,
                lambda k: records[k].pins == 0 and check(records[k]),  # type: ignore[index]
            )
        return [records[k] for k in keys]  # type: ignore[index]

    def touch(self, group: str, records: Sequence[PageRecord]) -> None:
        """A load used these pages: count the hits, and mark them recently used."""
        l3_only = self._l3_only[group]
        for record in records:
            record.hits += 1
            if record.l2_page is not None:
                record.used = next(USE_CLOCK)
                self._policies[group].touch(record.key)
            elif record.key in l3_only:
                l3_only.move_to_end(record.key)

    def drop_l2(self, group: str, key: PageKey) -> int:
        """Forget the page's L2 copy; returns the host page to free. The record stays while
        L3 has the page."""
        record = self._require(group, key)
        if record.l2_page is None:
            raise PageIndexError(f"group {group!r}: key {key.hex()} has no L2 copy to drop")
        if record.pins:
            raise PinError(
                f"group {group!r}: key {key.hex()} is pinned ({record.pins}); it cannot leave L2"
            )
        page, record.l2_page = record.l2_page, None
        self._l2_count[group] -= 1
        self._l2_keys[group].discard(key)
        self._policies[group].remove(key)
        self.watcher.l2_out(group, key)
        if record.in_l3:
            self._note_l3_only(group, [key])
        else:
            del self._records[group][key]
            self.watcher.forgotten(group, key)
        return page

    def drop_l3(self, group: str, key: PageKey) -> None:
        record = self._require(group, key)
        was_in_l3, record.in_l3 = record.in_l3, False
        self._l3_only[group].pop(key, None)
        if was_in_l3:
            self.watcher.l3_out(group, key)
        if record.l2_page is None and record.pins == 0:  # a pinned one goes at its last unpin
            del self._records[group][key]
            self.watcher.forgotten(group, key)

    def pin(self, group: str, keys: Sequence[PageKey]) -> None:
        records = [self._require(group, k) for k in keys]
        for record in records:
            self._pinned[group] += record.pins == 0
            record.pins += 1

    def unpin(self, group: str, keys: Sequence[PageKey]) -> None:
        records = [self._require(group, k) for k in keys]
        for record in records:
            if record.pins == 0:
                raise PinError(f"group {group!r}: key {record.key.hex()} is not pinned")
        for record in records:
            record.pins -= 1
            if record.pins:
                continue
            self._pinned[group] -= 1
            if record.l2_page is None and not record.in_l3:
                del self._records[group][record.key]  # no tier holds it any more
                self.watcher.forgotten(group, record.key)

    def l2_pages(self, group: str) -> int:
        return self._l2_count[group]

    def l2_records(self, group: str) -> list[PageRecord]:
        """Every page with an L2 copy (flush on shutdown, clear by the admin API)."""
        return [r for r in self._records[group].values() if r.l2_page is not None]

    def pinned_pages(self, group: str) -> int:
        """Records with pins (counted as pins come and go: every metrics scrape asks)."""
        return self._pinned[group]

    def l3_records(self, group: str) -> list[PageRecord]:
        return [r for r in self._records[group].values() if r.in_l3]

    def l3_only_pages(self, group: str) -> int:
        """Records of pages only L3 holds (bounded by `l3_only_max_pages`)."""
        return len(self._l3_only[group])

    def l3_pages(self, group: str) -> int:
        return sum(1 for r in self._records[group].values() if r.in_l3)

    def check_l2_keys(self) -> None:
        """The set of L2 keys is exactly the records with an L2 page (tests)."""
        for group, records in self._records.items():
            held = {key for key, record in records.items() if record.l2_page is not None}
            if held != self._l2_keys[group]:
                raise PageIndexError(
                    f"group {group!r}: {len(held ^ self._l2_keys[group])} keys differ between "
                    "the records with an L2 page and the set of L2 keys"
                )

    def _require(self, group: str, key: PageKey) -> PageRecord:
        record = self._records[group].get(key)
        if record is None:
            raise PageIndexError(f"group {group!r}: key {key.hex()} is not in the index")
        return record
