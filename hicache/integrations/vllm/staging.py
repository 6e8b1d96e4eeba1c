"""The vLLM worker's bookkeeping: `Staging`, the free pages of the staging pool the sidecar
maps (page 0 of each group is scratch), and `WorkerCounters`, what the worker did and how
long it took (written as JSON to the connector's `stats_path`).

A staging page's states: free -> `take`n (a store's or load's) -> `give`n back free once its
op was answered and ended; or, when the op got no reply (the sidecar may still copy into or
out of it), `quarantine`d under the op's epoch -> free again only once `reclaim` is told the
sidecar confirmed that epoch over (`Client.confirmed`)."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hicache.client.handle import Epoch

log = logging.getLogger("hicache.vllm")


class Staging:
    """Free staging pages per hicache group; page 0 of every group is the scratch page that
    positions vLLM does not need (its own prefix hit, a window it dropped) are loaded into."""

    def __init__(self, num_pages: Mapping[str, int]):
        self.num_pages = dict(num_pages)
        self._free = {g: list(range(n - 1, 0, -1)) for g, n in num_pages.items()}
        self._lock = threading.Lock()  # one worker thread today; cheap insurance
        # pages an unanswered op named, by its epoch: out of use until confirmed over
        self._quarantined: dict[Epoch, dict[str, list[int]]] = {}

    def take(self, wanted: Mapping[str, int]) -> dict[str, list[int]] | None:
        """`wanted[g]` pages of every group at once, or None (nothing taken)."""
        with self._lock:
            if any(len(self._free[g]) < n for g, n in wanted.items()):
                return None
            return {g: [self._free[g].pop() for _ in range(n)] for g, n in wanted.items()}

    def free(self) -> dict[str, int]:
        """Free pages per group now (the scratch page is never free)."""
        with self._lock:
            return {g: len(ids) for g, ids in self._free.items()}

    def give(self, pages: Mapping[str, Sequence[int]]) -> None:
        with self._lock:
            for g, ids in pages.items():
                self._free[g].extend(ids)

    def quarantine(self, pages: Mapping[str, Sequence[int]], epoch: Epoch) -> None:
        """Pages an op of `epoch` named and got no reply for: never taken before `reclaim`
        is told that epoch is over."""
        with self._lock:
            held = self._quarantined.setdefault(epoch, {})
            for g, ids in pages.items():
                held.setdefault(g, []).extend(ids)

    def reclaim(self, confirmed: Callable[[Epoch], bool]) -> int:
        """Free the pages of every quarantined epoch `confirmed` says is over; how many."""
        with self._lock:
            over = [e for e in self._quarantined if confirmed(e)]
            freed = 0
            for epoch in over:
                for g, ids in self._quarantined.pop(epoch).items():
                    self._free[g].extend(ids)
                    freed += len(ids)
            return freed

    def quarantined(self) -> int:
        with self._lock:
            return sum(len(ids) for held in self._quarantined.values() for ids in held.values())


@dataclass
class WorkerCounters:
    # "direct": the sidecar copies between L2 and vLLM's blocks; "staging": through staging
    data_plane: str = ""
    loads: int = 0
    load_failures: int = 0
    # of the loads, those served shorter than the lookup promised: vLLM kept the leading part
    loads_partial: int = 0
    pages_loaded: int = 0
    stores: int = 0  # answered by the sidecar
    # of those, the sidecar's reply said L2 holds every page the store named / only a prefix
    # (L2 too full for the rest)
    stores_in_l2: int = 0
    stores_truncated: int = 0
    # persisted_within_s: stores whose reply said L3 holds every page / did not by the bound
    stores_persisted: int = 0
    stores_not_persisted: int = 0
    # kv_producer: seconds its steps waited at wait_for_save for the sidecar's replies
    store_ack_wait_s: float = 0.0
    store_failures: int = 0
    stores_skipped_staging: int = 0
    loads_starved: int = 0  # loads recomputed because staging had too few free pages
    stores_skipped_failed_load: int = 0
    staging_quarantined: int = 0  # pages an unanswered op named, kept out of use
    staging_reclaimed: int = 0  # of those, freed once the sidecar confirmed their epoch over
    pages_stored: int = 0
    stores_unconfirmed: int = 0  # no reply, and the session did not end in time
    # registrations the sidecar refused `busy`: this process's earlier session still holds
    # the memory (service/claims.py); retried every retry_after_s
    registrations_busy: int = 0
    # kv_events_config on: hicache's stores handed to vLLM's event channel as events, and
    # those dropped past the worker's bound (vLLM took none for that long)
    kv_events_reported: int = 0
    kv_events_dropped: int = 0
    loads_unconfirmed: int = 0  # did not end in time, and had not ended before the next step
    # seconds: asking the sidecar to start loads (prefetch from L3 included), copying staging
    # into vLLM's blocks (0 when direct), the forward blocked in wait_layer, stores from start
    # to reply (on our store thread when direct), and what vLLM's steps waited for stores
    # (staging: the copy and the reply; direct: sending, and the replies not in yet when the
    # next step began)
    load_request_s: float = 0.0
    load_copy_s: float = 0.0
    layer_wait_s: float = 0.0
    store_s: float = 0.0
    store_on_step_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    stats_unwritable: bool = False

    def write(self, path: Path) -> None:
        """The counters as JSON (the connector's `stats_path`), replaced atomically; a path
        that cannot be written is said once, never raised into vLLM."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(asdict(self)))
            os.replace(tmp, path)
        except OSError as exc:
            if not self.stats_unwritable:
                log.error("kv_connector_extra_config.stats_path %s: cannot write: %s", path, exc)
            self.stats_unwritable = True

    def error(self, message: str) -> None:
        self.errors = [*self.errors[-19:], message]
        log.warning(message)
