"""`Discovery`: finding in L3 the pages of a prompt that the index does not know of.

The index starts empty after a restart, forgets L3-only pages beyond its bound, and never
hears of pages another process persisted; L3 may still hold them. `needed` answers, on the
lookup path and without I/O, whether asking L3 could extend a hit; `run` asks (one batched
`exists`) and records what L3 holds. L3's "absent" answers are remembered for a while
(`AbsentKeys`), so the same cold prompt looked up at every scheduling step costs one round
trip, not one per step — except for a lookup that waits for another engine's pages
(`trust_absent=False`: a decode instance, whose prefill on another host may have persisted
them since; counted in `AbsentKeys.asked_again`), and except for the groups another rank
writes (`distrusted`: a replicated group on a tensor-parallel rank other than 0, whose rank 0
may persist a page the moment after L3 said it lacked it). Lifecycle: one per `TieredCache`,
living as long as its index.
When L3 is swapped (`TieredCache.attach_l3`), `forget` drops the "absent" answers (they
were the old store's), and an answer that comes back afterwards is dropped too: the index
speaks of the attached store only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from hicache.index import AbsentKeys, Hit, PageKey, PrefixIndex
from hicache.storage import GuardedStore


class Discovery:
    def __init__(
        self,
        index: PrefixIndex,
        absent: AbsentKeys,
        current: Callable[[], GuardedStore | None],
        distrusted: frozenset[str] = frozenset(),
    ):
        self.index = index
        self.absent = absent
        self.current = current  # the store attached now (None: none)
        # groups another party writes to L3 (a replicated group on a TP rank other than 0:
        # rank 0 writes it): L3's "absent" for them is never trusted, as trust_absent=False
        self.distrusted = distrusted

    def _unknown(
        self, keys: Mapping[str, Sequence[PageKey]], start: int = 0
    ) -> Iterator[tuple[str, PageKey, bool]]:
        """(group, key, L3 just said absent) for every key from page `start` on that the
        index has no record of."""
        for group, group_keys in keys.items():
            for key in group_keys[start:]:
                if self.index.record(group, key) is None:
                    yield group, key, self.absent.fresh(group, key)

    def forget(self) -> None:
        """L3 was detached or replaced: its "absent" answers say nothing of the next store
        (the count of skipped keys goes on)."""
        old = self.absent
        self.absent = AbsentKeys(old.ttl_s, old.max_keys)
        self.absent.skipped = old.skipped

    def _trusts(self, group: str, trust_absent: bool) -> bool:
        return trust_absent and group not in self.distrusted

    def needed(self, token_ids: Sequence[int], hit: Hit) -> bool:
        """Could L3 extend this hit with pages the index does not know?"""
        if hit.pages_total == len(token_ids) // self.index.page_size_tokens:
            return False  # the whole prompt hits already: no hashing twice
        return self.needed_keys(self.index.keys(token_ids), hit)

    def needed_keys(
        self, keys: Mapping[str, Sequence[PageKey]], hit: Hit, trust_absent: bool = True
    ) -> bool:
        """`needed` for a prompt given by its keys. Pages from the hit's end on are checked,
        whole-prefix groups (full, sparse) first: past a page of theirs that is unknown and
        that L3 said moments ago it lacks, no page can extend the hit (that group's run ends
        there), so the scan stops — a cold prompt looked up at every step costs O(1) here,
        not one check per page. `trust_absent=False`: L3's remembered answers are not
        trusted (any unknown page past the hit is worth asking about)."""
        pages = min((len(k) for k in keys.values()), default=0)
        start, end = hit.pages_total, pages
        if start >= pages:
            return False
        rules = self.index.rules
        for group in sorted(keys, key=lambda g: not rules[g].needs_whole_prefix):
            whole = rules[group].needs_whole_prefix
            for offset, key in enumerate(keys[group][start:end]):
                if self.index.record(group, key) is None:
                    if not self._trusts(group, trust_absent) or not self.absent.fresh(group, key):
                        return True
                    if whole:
                        end = start + offset
                        break
        return False

    async def run(self, l3: GuardedStore, token_ids: Sequence[int]) -> int:
        """Ask L3 about the prompt's pages the index does not know of, and record those it
        holds. Returns how many it holds (0 when `l3` was swapped out before it answered)."""
        return await self.run_keys(l3, self.index.keys(token_ids))

    async def run_keys(
        self, l3: GuardedStore, keys: Mapping[str, Sequence[PageKey]], trust_absent: bool = True
    ) -> int:
        """`run` for a prompt given by its keys (`trust_absent=False`: asking L3 again about
        keys it said moments ago it lacks)."""
        unknown: list[tuple[str, PageKey]] = []
        for group, key, fresh in self._unknown(keys):
            if fresh and not self._trusts(group, trust_absent):
                self.absent.asked_again += 1
                unknown.append((group, key))
            elif fresh:  # L3 said so moments ago
                self.absent.skipped += 1
            else:
                unknown.append((group, key))
        if not unknown:
            return 0
        present, answered = await l3.exists_answered([key for _, key in unknown])
        if self.current() is not l3:
            return 0  # swapped meanwhile: the old store's answer is not the new one's
        found: dict[str, list[PageKey]] = {}
        absent = []
        for (group, key), here in zip(unknown, present, strict=True):
            if here:
                found.setdefault(group, []).append(key)
            else:
                absent.append((group, key))
        if answered:  # "absent" from a store that failed is no answer worth remembering
            self.absent.add(absent)
        for group, group_keys in found.items():  # one batch per group: none displaces another
            self.index.mark_l3_many(group, group_keys)
        return len(unknown) - len(absent)
