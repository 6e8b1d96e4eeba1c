"""What the SGLang storage backend moved, for SGLang's storage metrics: `get_stats()` hands
SGLang a `StorageMetrics` of the pages and bandwidth (GB/s) of each prefetch (`batch_get_v1`)
and backup (`batch_set_v1`) since the last call, as SGLang's own backends do; `totals` keeps
running counts for tests and logs."""

from __future__ import annotations

import threading
import time
from typing import Any


class BackendStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pages: dict[str, list[int]] = {"prefetch": [], "backup": []}
        self._gbps: dict[str, list[float]] = {"prefetch": [], "backup": []}
        self.totals = {
            "prefetch_pages": 0,
            "backup_pages": 0,
            "prefetch_calls": 0,
            "backup_calls": 0,
        }

    def moved(self, kind: str, pages: int, nbytes: int, started: float) -> None:
        seconds = max(time.perf_counter() - started, 1e-9)
        with self._lock:
            self.totals[f"{kind}_calls"] += 1
            self.totals[f"{kind}_pages"] += pages
            if pages:
                self._pages[kind].append(pages)
                self._gbps[kind].append(nbytes / seconds / 1e9)

    def drain(self) -> Any:
        """A `StorageMetrics` of what moved since the last call (None outside SGLang)."""
        with self._lock:
            pages, self._pages = self._pages, {"prefetch": [], "backup": []}
            gbps, self._gbps = self._gbps, {"prefetch": [], "backup": []}
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        return StorageMetrics(
            prefetch_pgs=pages["prefetch"],
            backup_pgs=pages["backup"],
            prefetch_bandwidth=gbps["prefetch"],
            backup_bandwidth=gbps["backup"],
        )
