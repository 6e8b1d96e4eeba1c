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

Lifecycle (SGLang's scheduler process):
    created (settings checked; a bad one fails SGLang's start, naming the key)
    -> register_mem_pool_host (host pool shared in place and checked against the sidecar's
       layout; a mismatch leaves the backend unattached, logged: every call then answers
       "absent") -> register_mem_host_pool_v2 ("kv": the same pool; "mamba": checked against
       the layout's state group and shared in place with the KV pool, one memfd under both;
       other side pools noted, not mapped)
    -> on_host_pools_registered (a layout with a state group and no Mamba pool mapped stays
       unattached, logged; else first attach: hello + pools registered; a sidecar that is
       down is attached later, on the first call after `retry_after_s`)
    -> ready (set at the end of on_host_pools_registered: SGLang starts its storage threads
       before it registers the v2 pools, and every data-path call answers "absent" / "not
       stored" until then, so no call attaches with a partial manifest)
    -> serving (the data path; a side pool SGLang registers now, at run time, is not mapped
       and a pool of a name already mapped is no longer served: sharing it would move the
       pools onto a new memfd under the live session)
    -> close() (runtime detach, or shutdown: not ready; the session ends, the sidecar drops
       its mapping; nothing of the host pool is kept)
`clear()` leaves the shared cache alone: it is every engine's (clear it through the sidecar).

v2 (hybrid models): SGLang's Mamba side pool is mapped as the layout's state group
(`side_pools`), its SWA side pool as the sliding group (`host_pools`), both moved by the v2
calls (`storage_v2`, hit policies in `hit_policies`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from hicache.assembly import geometries as deployment_geometries
from hicache.client import Client, PromptKeys, connect_deployment
from hicache.errors import HicacheError
from hicache.integrations.core.shared_memory import share_in_place
from hicache.integrations.core.sidecar_link import SidecarLink
from hicache.integrations.sglang.host_pools import (
    HostKv,
    SideRows,
    check_kv,
    host_pages,
    host_pool_manifest,
    kv_group,
    kv_rows,
    tenant_of,
)
from hicache.integrations.sglang.index_pools import (
    HostIndex,
    IndexPoolError,
    check_index,
    index_rows,
    needs_index,
)
from hicache.integrations.sglang.settings import BackendSettings, check_ranks
from hicache.integrations.sglang.side_pools import (
    HostState,
    SidePoolError,
    check_state,
    sliding_group,
    state_group,
    state_rows,
)
from hicache.integrations.sglang.stats import BackendStats
from hicache.integrations.sglang.storage_v2 import Attached, SidePoolOps, pool_name
from hicache.memory import GroupGeometry

log = logging.getLogger("hicache.sglang")


def page_ids(keys: Sequence[str]) -> list[bytes]:
    """SGLang's page keys as the ids the sidecar keys under this engine's namespace."""
    return [key.encode() for key in keys]


class HicacheStorage(SidePoolOps, HiCacheStorage):  # type: ignore[misc]
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
        self.recent = threading.local()  # per controller thread: its last KV load
        self.side_pools: dict[str, str] = {}  # v2 pools named by SGLang, not mapped: why
        self._lock = threading.Lock()
        self.link = SidecarLink(
            self._connect,
            self._register,
            retry_after_s=self.settings.retry_after_s,
            name=f"sglang rank {self.tp_rank}",
            log=log,
        )

    # ---- attach ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        with self._lock:
            try:
                host = HostKv.of(mem_pool_host)
                geometries = self._geometries()
                page_size_tokens = next(iter(geometries.values())).page_size_tokens
                group = kv_group(host, geometries, page_size_tokens)
                region = share_in_place(
                    [mem_pool_host.kv_buffer.untyped_storage()],
                    "SGLang's host KV pool",
                    "hicache-engine-host",
                )
            except HicacheError as exc:
                self.refused = str(exc)
                log.error("hicache: SGLang's host pool is not attached: %s", exc)
                return
            self.attached = Attached(region, host, group, mem_pool_host.kv_buffer)
            self.refused = None

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = pool_name(host_pool_name)
        if name == "kv":
            return  # the anchor pool, registered by register_mem_pool_host
        maps = {"mamba": self._map_state, "swa": self._map_window, "indexer": self._map_index}
        with self._lock:
            attached = self.attached
            why = "SGLang's KV host pool is not attached"
            if self.ready and attached is not None:
                # at run time (SGLang's `register_host_pool_entry`): sharing it would move the
                # pools onto a new memfd under the live session, so it is not mapped; a pool
                # of a name already mapped is SGLang's no longer, so it is not served either
                attached.replaced.add(name)
                why = (
                    "registered after the host pools were attached (at run time); hicache "
                    "maps side pools at attach only"
                )
            elif name in maps and attached is not None:
                try:
                    maps[name](attached, host_pool)
                    return
                except HicacheError as exc:
                    why = str(exc)
            elif name not in maps:
                why = f"{type(host_pool).__name__} side pools are not mapped by hicache yet"
            self.side_pools[name] = why
        log.warning(
            "hicache: SGLang's %s side pool is not mapped (%s): requests that need it recompute",
            name,
            why,
        )

    def _map_state(self, attached: Attached, host_pool: Any) -> None:
        """The Mamba host pool checked against the layout's state group, then shared in place
        with the pools mapped before it."""
        geometries = self._geometries()
        group = state_group(geometries)
        state = HostState.of(host_pool, geometries[group])
        check_state(state, group, geometries[group])
        self._share(attached, [b.buffer.untyped_storage() for b in state.buffers])
        attached.state, attached.state_group = state, group

    def _map_window(self, attached: Attached, host_pool: Any) -> None:
        """The SWA host pool (a KV host pool of the sliding layers) checked against the
        layout's sliding group, then shared in place with the pools mapped before it."""
        geometries = self._geometries()
        group = sliding_group(geometries)
        host = HostKv.of(host_pool)
        if host.layout != attached.host.layout:
            raise SidePoolError(
                f"SGLang's SWA host pool is {host.layout}, its KV host pool "
                f"{attached.host.layout}; hicache maps them in one layout"
            )
        check_kv(host, group, geometries[group], attached.host.page_size)
        self._share(attached, [host_pool.kv_buffer.untyped_storage()])
        attached.swa, attached.swa_buffer, attached.swa_group = host, host_pool.kv_buffer, group

    def _map_index(self, attached: Attached, host_pool: Any) -> None:
        """A DSA model's indexer host pool checked against the index rows of the KV pool's
        group, then shared in place with the pools mapped before it."""
        geometries = self._geometries()
        if not needs_index(geometries, attached.group):
            raise IndexPoolError(
                f"the sidecar's group {attached.group!r} keeps no indexer keys: give a DSA model "
                "(deepseek_v32, glm_moe_dsa) its own config.json, with model.index_format: "
                "fp8_scaled"
            )
        index = HostIndex.of(host_pool, attached.host)
        check_index(index, attached.group, geometries[attached.group])
        attached.index = index
        try:
            self._share(attached, [])  # `storages()` and `reaches()` name its buffer now
        except HicacheError:
            attached.index = None
            raise

    @staticmethod
    def _share(attached: Attached, more: list[Any]) -> None:
        """Every host buffer mapped so far and `more` under one new sealed memfd (the sidecar
        registers one memfd for every group); the old one closed."""
        reach = attached.reaches() + [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in more]
        region = share_in_place(
            attached.storages() + more, "SGLang's host pools", "hicache-engine-host", reach
        )
        old, attached.region = attached.region, region
        old.close()

    def on_host_pools_registered(self) -> None:
        attached = self.attached
        if attached is None:
            return
        missing = sorted(set(self._geometries()) - set(attached.groups().values()))
        if missing:  # every group of the layout must be registered
            self.refused = (
                f"the sidecar's layout has groups {missing} no SGLang host pool hicache maps "
                f"was registered for ({self.side_pools or 'none registered'})"
            )
            self._unattach(attached)
            return
        if attached.index is None and needs_index(self._geometries(), attached.group):
            self.refused = (
                f"the sidecar's group {attached.group!r} keeps a DSA model's indexer keys and "
                "no SGLang DSA indexer host pool hicache maps was registered "
                f"({self.side_pools or 'none registered'})"
            )
            self._unattach(attached)
            return
        self.ready = True  # the data path may run from now on
        self.link.client()  # attach now; a sidecar that is down is tried again later

    def _unattach(self, attached: Attached) -> None:
        log.error("hicache: SGLang's host pools are not attached: %s", self.refused)
        with self._lock:
            self.attached = None
        attached.region.close()

    def _geometries(self) -> dict[str, GroupGeometry]:
        """The sidecar's page geometries, derived as the client derives them (the
        deployment's dtypes and page size, read by `hicache.assembly`)."""
        loaded = self.settings.loaded
        return deployment_geometries(loaded.deployment, loaded.layer_map())

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

    def _register(self, client: Client) -> None:
        attached = self.attached
        assert attached is not None
        geometry = client.geometries[attached.group]
        side = {}
        if attached.state is not None and attached.state_group is not None:
            state_geometry = client.geometries[attached.state_group]
            offsets, strides = state_rows(attached.region, attached.state, state_geometry)
            side[attached.state_group] = SideRows(
                state_geometry, attached.state.slots, offsets, strides
            )
        if attached.swa is not None and attached.swa_group is not None:
            offsets, strides = kv_rows(attached.region, attached.swa_buffer, attached.swa)
            side[attached.swa_group] = SideRows(
                client.geometries[attached.swa_group], attached.swa.pages, offsets, strides
            )
        more = None
        if attached.index is not None:
            more = index_rows(attached.region, attached.index, geometry)
        client.register_pools(
            host_pool_manifest(
                attached.region,
                attached.manifest,
                attached.host,
                attached.group,
                geometry,
                side,
                more,
            )
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
        self.remember_load(keys, pages, loaded)  # a DSA model's indexer asks next (storage_v2)
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
