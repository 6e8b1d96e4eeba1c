"""`HicacheStorage`: hicache as SGLang's HiCache storage backend (L3), shared by every SGLang
engine on the host through one `hicache serve`.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicache",
        "module_path": "hicache.integrations.sglang", "class_name": "HicacheStorage",
        "interface_v1": 1, "config": "deploy.yaml"}'

Data plane. SGLang's host KV pool is shared with the sidecar in place (`core.shared_memory`:
the pages under it get a sealed memfd; any `allocator`, "shm" included, since SGLang's own
memfd is not sealed and the sidecar maps only sealed ones) and registered as this engine's
pool: a host page of SGLang is a device page of the sidecar (`host_pools`). `batch_set_v1`
has the sidecar copy the pages from SGLang's host pool into its L2 (L3 behind it),
`batch_get_v1` copies them back: one memcpy per page each way, no bytes on the socket.

Keys. SGLang's page hashes name a page and its whole prefix but no model, rank, dtype or
layout. They go to the sidecar as ids under the session's namespace (`KeySpec.of_ids`: the
namespace's root — model, dtype, geometry, page size, TP rank and size, tenant — hashed with
the id): engines of one model, rank and page byte layout (`host_pools.tenant_of`) share pages,
nothing else does. TP ranks each hold their own heads (SGLang's MHA pools are per rank), so
each rank attaches as its own rank; DP replicas share. An MLA model's latent is the same on
every rank (`MLATokenToKVPoolHost`, `host_pools`): the sidecar keys its MLA group as rank 0
on every rank, so every rank reads what rank 0 (SGLang's only MLA writer) stored — from L3,
its one copy every rank reaches: rank 0's store is answered once L3 holds it (at most
`persisted_within_s`; not by then: answered not stored), as SGLang's other ranks query it
right after, and they never trust an earlier "absent" of L3 for that group. PP,
attention CP and DCP > 1 are refused (hicache's layouts are not split that way).

Contract with SGLang's controller (three threads call at once: prefetch, prefetch IO, backup):
every data-path method returns per-key booleans (or a leading count), True only for a leading
run the sidecar vouches for (`batch_exists` never over-reports: it is the sidecar's L2 + L3
hit of those keys), never raises (`core.sidecar_link`), and is bounded by `timeout_s` per
request and `load_timeout_s` per load (the sidecar waits for its L3-only pages up to half of
`timeout_s`, not its prefetch policy's wait: SGLang's prefetch IO thread would rather wait
than miss; past `load_timeout_s` the load is cancelled and waited for as long
again, and answers False only once it ended or its session was detached: SGLang reuses those
host slots at once, `storage_v2._end_load`). A set is idempotent (pages the sidecar holds count as
stored) and atomic per page (the sidecar indexes a page only once its copy landed). Sidecar
down: no hits, no stores, SGLang recomputes; it is tried again every `retry_after_s`.

Lifecycle (SGLang's scheduler process; the attach steps are `pool_attach`'s):
    created (settings checked; a bad one fails SGLang's start, naming the key)
    -> register_mem_pool_host (host pool shared in place and checked against the sidecar's
       layout; a mismatch leaves the backend unattached, logged: every call then answers
       "absent") -> register_mem_host_pool_v2 ("kv": the same pool; "mamba", "swa",
       "indexer": checked against their groups (rows) and shared in place with the KV pool,
       one memfd under all; other side pools noted, not mapped)
    -> on_host_pools_registered (a layout group, or a DSA group's index rows, that no mapped
       pool holds leaves the backend unattached, logged; else first attach: hello + pools
       registered; a sidecar that is down is attached later, on the first call after
       `retry_after_s`)
    -> ready (set at the end of on_host_pools_registered: SGLang starts its storage threads
       before it registers the v2 pools, and every data-path call answers "absent" / "not
       stored" until then, so no call attaches with a partial manifest)
    -> serving (the data path; a side pool SGLang registers now, at run time, is not mapped
       and a pool of a name already mapped is no longer served: sharing it would move the
       pools onto a new memfd under the live session)
    -> close() (runtime detach, or shutdown: not ready; the session ends, the sidecar drops
       its mapping; nothing of the host pool is kept)
`clear()` leaves the shared cache alone: it is every engine's (clear it through the sidecar).

v2 (hybrid and sparse models): SGLang's Mamba side pool is mapped as the layout's state group
(`side_pools`), its SWA side pool as the sliding group (`host_pools`), a DSA model's indexer
pool as the index rows of the KV group's own pages (`index_pools`), all moved by the v2 calls
(`storage_v2`, hit policies in `hit_policies`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo

from hicache.client import Client, PromptKeys, connect_deployment
from hicache.integrations.core.sidecar_link import SidecarLink
from hicache.integrations.sglang.host_pools import host_pages, tenant_of
from hicache.integrations.sglang.index_pools import LastKvLoads
from hicache.integrations.sglang.pool_attach import PoolAttach
from hicache.integrations.sglang.settings import BackendSettings, check_ranks
from hicache.integrations.sglang.stats import BackendStats
from hicache.integrations.sglang.storage_v2 import Attached, SidePoolOps

log = logging.getLogger("hicache.sglang")


def page_ids(keys: Sequence[str]) -> list[bytes]:
    """SGLang's page keys as the ids the sidecar keys under this engine's namespace."""
    return [key.encode() for key in keys]


class HicacheStorage(SidePoolOps, PoolAttach):
    """hicache's `dynamic` HiCache storage backend for SGLang (see the module doc)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None):
        self.settings = BackendSettings.parse(dict(storage_config.extra_config or {}))
        check_ranks(storage_config)
        self.tp_rank = int(storage_config.tp_rank)
        self.tp_size = int(storage_config.tp_size)
        # SGLang's only writer of a rank-replicated (MLA) cache at TP > 1: its ranks read
        # what it stores from L3, so its stores are answered once L3 holds them
        self.writes_for_ranks = (
            bool(getattr(storage_config, "is_mla_model", False))
            and self.tp_size > 1
            and self.tp_rank == 0
        )
        self.stats = BackendStats()
        self.attached: Attached | None = None
        # the data path's gate: set once SGLang registered every host pool (it starts its
        # storage threads before that, `on_host_pools_registered`), cleared by close()
        self.ready = False
        self.refused: str | None = None  # why SGLang's pools could not be mapped
        self.recent = LastKvLoads()  # per controller thread: its last KV load
        self.side_pools: dict[str, str] = {}  # v2 pools named by SGLang, not mapped: why
        self._lock = threading.Lock()
        self.link = SidecarLink(
            self._connect,
            self._register,
            retry_after_s=self.settings.retry_after_s,
            name=f"sglang rank {self.tp_rank}",
            log=log,
        )

    def _connect(self) -> Client:
        attached = self.attached
        assert attached is not None
        tenant = self.settings.tenant or tenant_of(attached.host.layout)
        extra: dict[str, Any] = {"token": self.settings.token} if self.settings.token else {}
        return connect_deployment(
            self.settings.loaded,
            tp_rank=self.tp_rank,
            tenant=tenant,
            engine=f"sglang tp{self.tp_rank}/{self.tp_size}",
            timeout_s=self.settings.timeout_s,
            **extra,
        )

    # ---- the data path (SGLang's three controller threads) --------------------------------

    def _keys(self, client: Client, keys: Sequence[str]) -> PromptKeys:
        return client.key_spec().of_ids(page_ids(keys))

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        attached = self.live()
        if attached is None or not keys:
            return 0
        size = attached.host.page_size
        group = attached.group

        def ask(client: Client) -> int:
            return client.lookup_keys(self._keys(client, keys), [group]).tokens_total // size

        return int(self.link.use("batch_exists", ask, 0))

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        attached = self.live()
        pages = (
            None
            if attached is None
            else host_pages(host_indices, attached.host.page_size, len(keys))
        )
        if attached is None or pages is None or not keys:
            return [False] * len(keys)
        started = time.perf_counter()

        def load(client: Client) -> int:
            handle = client.load_keys(
                self._keys(client, keys),
                {attached.group: pages},
                groups=[attached.group],
                l3_wait_s=self.settings.l3_wait_s,  # SGLang's prefetch IO: rather wait than miss
            )
            if handle is None:
                return 0
            state = self._end_load(client, handle, "batch_get_v1")  # storage_v2
            return handle.tokens // attached.host.page_size if state == "done" else 0

        loaded = int(self.link.use("batch_get_v1", load, 0))
        self.recent.record(keys, pages, loaded)  # a DSA model's indexer asks next (storage_v2)
        self.stats.moved("prefetch", loaded, loaded * self._page_bytes(), started)
        return [i < loaded for i in range(len(keys))]

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        attached = self.live()
        pages = (
            None
            if attached is None
            else host_pages(host_indices, attached.host.page_size, len(keys))
        )
        if attached is None or pages is None or not keys:
            return [False] * len(keys)
        started = time.perf_counter()

        wait = self.settings.persisted_within_s if self.writes_for_ranks else 0.0

        def store(client: Client) -> int:
            pages_of = attached.pages_of(attached.group, [*pages])
            reply = client.store_keys(self._keys(client, keys), pages_of, persisted_within_s=wait)
            cut = reply.get("truncated_to_tokens")
            if wait and not reply.get("persisted"):
                self.link.note(
                    "persisted",
                    f"hicache {self.link.name}: the MLA latents stored did not reach L3 within "
                    f"{wait} s (no L3, or a slow one); SGLang's other ranks read them from L3 "
                    "only, so the backup is answered not stored",
                )
                return 0
            return len(keys) if cut is None else int(cut) // attached.host.page_size

        stored = int(self.link.use("batch_set_v1", store, 0))
        self.stats.moved("backup", stored, stored * self._page_bytes(), started)
        return [i < stored for i in range(len(keys))]

    def _page_bytes(self) -> int:
        """One page's bytes in SGLang's host pools: K and V (or the latent, with a DSA
        model's index keys and scales) of every layer."""
        attached = self.live()
        if attached is None:
            return 0
        host, index = attached.host, attached.index
        kv = host.row_bytes * host.layers * len(host.tensors)
        return kv + (0 if index is None else index.page_bytes * index.layers)

    # ---- the legacy interface: never called with interface_v1 (settings require it) ------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("hicache's storage backend serves interface_v1 only")

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> Any:
        raise NotImplementedError("hicache's storage backend serves interface_v1 only")

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        raise NotImplementedError("hicache's storage backend serves interface_v1 only")

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        raise NotImplementedError("hicache's storage backend serves interface_v1 only")

    # ---- admin ----------------------------------------------------------------------------

    def clear(self) -> None:
        log.info(
            "hicache: clear() leaves the shared cache alone (every engine's); clear it through "
            "the sidecar"
        )

    def get_stats(self) -> Any:
        return self.stats.drain()

    def close(self) -> None:
        """Detach: the session ends (the sidecar drops its mapping of the host pool)."""
        self.ready = False
        self.link.close()
        with self._lock:
            attached, self.attached = self.attached, None
        if attached is not None:
            attached.region.close()
