"""`IndexWatcher`: what a `PrefixIndex` tells an observer as pages come and go, so something
outside the cache (the sidecar's KV events, `service/kv_events.py`) can mirror what each tier
holds without polling or re-walking the index.

The index calls, synchronously and on the thread that changes it (the sidecar's event loop):
`l2_in` once a page's L2 copy is indexed (`insert_l2`), `l2_out` when it leaves L2
(`drop_l2`: eviction, admin clear), `l3_in` for pages newly marked as held by L3
(`mark_l3_many`), `l3_out` when L3 no longer holds one (`drop_l3`), and `forgotten` when the
index deletes a record altogether (no tier it knows of holds the page, or the bound on
L3-only records let it go). A watcher must be cheap and must not raise: it runs inside the
index's bookkeeping. `NO_WATCHER` does nothing (the default)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

PageKey = bytes


class IndexWatcher(Protocol):
    def l2_in(self, group: str, key: PageKey) -> None: ...

    def l2_out(self, group: str, key: PageKey) -> None: ...

    def l3_in(self, group: str, keys: Sequence[PageKey]) -> None: ...

    def l3_out(self, group: str, key: PageKey) -> None: ...

    def forgotten(self, group: str, key: PageKey) -> None: ...


class _NoWatcher:
    def l2_in(self, group: str, key: PageKey) -> None:
        pass

    def l2_out(self, group: str, key: PageKey) -> None:
        pass

    def l3_in(self, group: str, keys: Sequence[PageKey]) -> None:
        pass

    def l3_out(self, group: str, key: PageKey) -> None:
        pass

    def forgotten(self, group: str, key: PageKey) -> None:
        pass


NO_WATCHER: IndexWatcher = _NoWatcher()
