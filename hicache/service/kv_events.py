"""`KvEvents`: what the sidecar's shared cache holds, published as vLLM KV events
(`service.kv_events`, off by default) — one publisher for every engine of the host, so a
KV-aware router learns of pages hicache holds for all of them.

What is published, for one cache group (the first whole-prefix token group: a plain model's
only one, a hybrid's full-attention group — no real config has two; windows and states are
not published, docs/design.md says why; a hicache page is one vLLM block, `kv_hashes.py`):
- `BlockStored` medium `CPU` when a page enters L2 (a store's backup acknowledged, or an L3
  fetch brings it back), `STORAGE` when L3 newly holds it (a persist);
- `BlockRemoved` with the medium when it leaves that tier (eviction, the admin clear of L2
  or L3, L3 found to lack it), or when the index forgets an L3-only page (it can no longer
  vouch for it);
- `AllBlocksCleared` once at start: a router drops what a previous run of this sidecar said.
An admin clear publishes `BlockRemoved` for exactly what it dropped rather than
`AllBlocksCleared`: clearing L2 leaves L3's copies (and other media) valid, which a router
would otherwise forget.

The block hashes are vLLM's, computed here from the token ids a store carries (every store
names its tokens; a lookup session's keys-only requests store nothing). A page whose tokens
the sidecar never saw (found in L3 by discovery, fetched back into L2) has no hash and is not
published (counted, `pages_unhashed`). Several namespaces (tensor-parallel ranks, tenants)
may hold the same block: the host holds it while any does, so `BlockStored` goes out when the
first one takes it and `BlockRemoved` when the last one lets it go (a count per medium and
hash).

Lifecycle of a page's entry (`NamespaceEvents.pages`): a store names its tokens (`storing`:
the store is active while it runs) -> `l2_in` of a key no entry has finds it among the
active stores' keys (computed then, once per store), computes its hash and publishes CPU ->
`l3_in` STORAGE -> `l2_out` / `l3_out` remove per medium -> `forgotten` (the index deleted
the record) removes what is left and drops the entry. Events of one turn of the event loop are
coalesced (consecutive blocks of a chain in one `BlockStored`) and handed to the publisher
thread as one batch: never blocking, a full queue drops the batch and counts it."""

from __future__ import annotations

import asyncio
import contextlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hicache.config.service_schema import KvEventsSection
from hicache.index import PrefixIndex
from hicache.service.kv_hashes import BlockHasher
from hicache.service.kv_publisher import Event, ZmqEventPublisher

CPU, STORAGE = "CPU", "STORAGE"


@dataclass(slots=True)
class _Page:
    block_hash: bytes
    parent: bytes | None
    tokens: array[int]
    media: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Storing:
    """One store's prompt, while it runs: its keys computed only when a page it names enters
    L2 (a store of pages L2 already holds costs nothing), hashes computed on demand."""

    tokens: Sequence[int]
    keys: list[bytes] | None = None
    positions: dict[bytes, int] = field(default_factory=dict)
    hashes: dict[int, bytes] = field(default_factory=dict)

    def position(self, key: bytes, index: PrefixIndex, group: str) -> int | None:
        if self.keys is None:
            self.keys = index.keys(self.tokens)[group]
            self.positions = {k: i for i, k in enumerate(self.keys)}
        return self.positions.get(key)


class KvEvents:
    def __init__(self, publisher: ZmqEventPublisher, hasher: BlockHasher, block_size: int):
        self.publisher = publisher
        self.hasher = hasher
        self.block_size = block_size
        self._held: dict[tuple[str, bytes], int] = {}  # namespaces holding a block, per medium
        self._pending: list[Event] = []
        self._flush_scheduled = False
        self.pages_unhashed = 0
        self.publish([("cleared",)])

    def watch(self, index: PrefixIndex) -> NamespaceEvents:
        """Mirror one namespace's index (its watcher from now on)."""
        watcher = NamespaceEvents(self, index)
        index.watcher = watcher
        return watcher

    # ---- from the watchers (the event loop) ------------------------------------------------

    def stored(self, page: _Page, medium: str) -> None:
        key = (medium, page.block_hash)
        count = self._held.get(key, 0)
        self._held[key] = count + 1
        if count == 0:
            self._add(("stored", medium, page))

    def removed(self, page: _Page, medium: str) -> None:
        key = (medium, page.block_hash)
        count = self._held.get(key, 0)
        if count <= 1:
            self._held.pop(key, None)
            if count == 1:
                self._add(("removed", medium, page))
        else:
            self._held[key] = count - 1

    def _add(self, event: tuple[str, str, _Page]) -> None:
        self._pending.append(event)
        if self._flush_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop (a test driving an index): publish now
            self.flush()
            return
        self._flush_scheduled = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Coalesce the pending events into one batch and hand it to the publisher."""
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        if pending:
            self.publish(self._coalesce(pending))

    def publish(self, events: list[Event]) -> None:
        self.publisher.submit(events)

    def _coalesce(self, pending: list[Any]) -> list[Event]:
        ext = self.hasher.external
        out: list[Event] = []
        last: tuple[str, str, bytes] | None = None  # (kind, medium, last hash) of out[-1]
        for kind, medium, page in pending:
            if kind == "stored":
                if last == ("stored", medium, page.parent):
                    out[-1][2].append(ext(page.block_hash))
                    out[-1][4].extend(page.tokens)
                else:
                    parent = None if page.parent is None else ext(page.parent)
                    hashes = [ext(page.block_hash)]
                    out.append(
                        ("stored", medium, hashes, parent, list(page.tokens), self.block_size)
                    )
                last = ("stored", medium, page.block_hash)
            else:
                if last is not None and last[:2] == ("removed", medium):
                    out[-1][2].append(ext(page.block_hash))
                else:
                    out.append(("removed", medium, [ext(page.block_hash)]))
                last = ("removed", medium, b"")
        return out

    def counts(self) -> dict[str, int]:
        """Events and batches sent and dropped (the metrics' source)."""
        s = self.publisher.stats()
        return {
            "events_sent": s.events_sent,
            "events_dropped": s.events_dropped,
            "batches_sent": s.batches_sent,
            "batches_dropped": s.batches_dropped,
            "pages_unhashed": self.pages_unhashed,
        }

    def stats(self) -> dict[str, Any]:
        s = self.publisher.stats()
        return {
            "endpoint": self.publisher.endpoint,
            "replay_endpoint": self.publisher.replay_endpoint,
            "replays": s.replays,
            "replays_malformed": s.replays_malformed,
            "batches_sent": s.batches_sent,
            "events_sent": s.events_sent,
            "batches_dropped": s.batches_dropped,
            "events_dropped": s.events_dropped,
            "queued_batches": s.queued_batches,
            "subscriptions": s.subscriptions,
            "pages_unhashed": self.pages_unhashed,
            "blocks_held": {m: sum(1 for k in self._held if k[0] == m) for m in (CPU, STORAGE)},
        }

    def close(self) -> None:
        self.flush()
        self.publisher.close()


class NamespaceEvents:
    """One namespace's `IndexWatcher`: its published group's pages by key."""

    def __init__(self, events: KvEvents, index: PrefixIndex):
        self.events = events
        self.index = index
        whole = [g for g, rule in index.rules.items() if rule.needs_whole_prefix]
        self.group: str | None = whole[0] if whole else None
        self.pages: dict[bytes, _Page] = {}
        self._active: list[_Storing] = []  # stores running now, oldest first

    @contextlib.contextmanager
    def storing(self, tokens: Sequence[int]) -> Iterator[None]:
        """While a store of `tokens` runs, its pages' tokens are known (for `l2_in`)."""
        if self.group is None or len(tokens) < self.events.block_size:
            yield
            return
        store = _Storing(tokens)
        self._active.append(store)
        try:
            yield
        finally:
            self._active.remove(store)

    def _page_of(self, key: bytes) -> _Page | None:
        page = self.pages.get(key)
        if page is not None or self.group is None:
            return page
        for store in reversed(self._active):  # the newest store naming it first
            pos = store.position(key, self.index, self.group)
            if pos is None:
                continue
            size = self.events.block_size
            parent = self._hash_at(store, pos - 1) if pos else None
            tokens = store.tokens[pos * size : (pos + 1) * size]
            block_hash = self.events.hasher.block(parent, tokens)
            store.hashes[pos] = block_hash
            page = self.pages[key] = _Page(block_hash, parent, array("q", tokens))
            return page
        return None

    def _hash_at(self, store: _Storing, pos: int) -> bytes:
        """Block `pos`'s hash of a store's prompt: from the nearest known block before it."""
        start = pos
        keys = store.keys
        assert keys is not None  # computed by `position` before any hash is asked for
        while start >= 0 and start not in store.hashes:
            known = self.pages.get(keys[start])
            if known is not None:
                store.hashes[start] = known.block_hash
                break
            start -= 1
        parent = store.hashes[start] if start >= 0 else None
        size = self.events.block_size
        for i in range(start + 1, pos + 1):
            parent = self.events.hasher.block(parent, store.tokens[i * size : (i + 1) * size])
            store.hashes[i] = parent
        assert parent is not None
        return parent

    # ---- IndexWatcher ---------------------------------------------------------------------

    def l2_in(self, group: str, key: bytes) -> None:
        if group != self.group:
            return
        page = self._page_of(key)
        if page is None:
            self.events.pages_unhashed += 1
            return
        self._enter(page, CPU)

    def l2_out(self, group: str, key: bytes) -> None:
        if group == self.group and (page := self.pages.get(key)) is not None:
            self._leave(page, CPU)

    def l3_in(self, group: str, keys: Sequence[bytes]) -> None:
        if group != self.group:
            return
        for key in keys:
            page = self.pages.get(key)
            if page is not None:
                self._enter(page, STORAGE)

    def l3_out(self, group: str, key: bytes) -> None:
        if group == self.group and (page := self.pages.get(key)) is not None:
            self._leave(page, STORAGE)

    def forgotten(self, group: str, key: bytes) -> None:
        if group != self.group:
            return
        page = self.pages.pop(key, None)
        if page is not None:
            for medium in sorted(page.media):
                self._leave(page, medium)

    def _enter(self, page: _Page, medium: str) -> None:
        if medium not in page.media:
            page.media.add(medium)
            self.events.stored(page, medium)

    def _leave(self, page: _Page, medium: str) -> None:
        if medium in page.media:
            page.media.discard(medium)
            self.events.removed(page, medium)


def storing_tokens(
    events: KvEvents | None, index: PrefixIndex, tokens: Sequence[int]
) -> contextlib.AbstractContextManager[None]:
    """The store handler's context: `NamespaceEvents.storing` when KV events are on."""
    watcher = index.watcher
    if events is None or not isinstance(watcher, NamespaceEvents):
        return contextlib.nullcontext()
    return watcher.storing(tokens)


def start_kv_events(section: KvEventsSection, page_size_tokens: int) -> KvEvents:
    """The publisher `service.kv_events` describes, bound (a ConfigError naming the key when
    it cannot be, or when pyzmq / msgspec are missing)."""
    publisher = ZmqEventPublisher(
        section.endpoint,
        section.topic,
        section.queue_depth,
        section.hwm,
        replay_endpoint=section.replay_endpoint,
        buffer_steps=section.buffer_steps,
    )
    hasher = BlockHasher(section.hash_algo, section.hash_seed, int_hashes=section.int_hashes)
    return KvEvents(publisher, hasher, page_size_tokens)
