"""How `HicacheStorage` (`storage_backend`) attaches SGLang's host pools: the KV host pool and
each v2 side pool checked against the sidecar's layout and shared in place under one sealed
memfd (`core.shared_memory`), then registered with the sidecar as one manifest.

    register_mem_pool_host: the KV host pool (`host_pools`) -> the KV group
    register_mem_host_pool_v2: "mamba" -> the state group (`side_pools`), "swa" -> the
        sliding group, "indexer" -> the index rows of the KV group (`index_pools`); any other
        pool, or one registered after the attach, is noted (`side_pools`) and not mapped
    on_host_pools_registered: every group of the layout (and a DSA group's index rows) mapped,
        or the backend stays unattached (`refused` says why; SGLang recomputes)
    _register: the manifest of every mapped pool, sent on each (re)connect of the link

A mapping that fails leaves what was attached before as it was (the old memfd is closed only
once the new one holds every buffer).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from hicache.assembly import geometries as deployment_geometries
from hicache.client import Client
from hicache.errors import HicacheError
from hicache.integrations.core.shared_memory import share_in_place
from hicache.integrations.core.sidecar_link import SidecarLink
from hicache.integrations.sglang.host_pools import (
    HostKv,
    SideRows,
    check_kv,
    host_pool_manifest,
    kv_group,
    kv_rows,
)
from hicache.integrations.sglang.index_pools import (
    HostIndex,
    IndexPoolError,
    check_index,
    index_rows,
    needs_index,
)
from hicache.integrations.sglang.settings import BackendSettings
from hicache.integrations.sglang.side_pools import (
    HostState,
    SidePoolError,
    check_state,
    sliding_group,
    state_group,
    state_rows,
)
from hicache.integrations.sglang.storage_v2 import Attached, pool_name
from hicache.memory import GroupGeometry

log = logging.getLogger("hicache.sglang")


class PoolAttach(HiCacheStorage):  # type: ignore[misc]
    """`HicacheStorage`'s attach of SGLang's host pools (see the module doc)."""

    attached: Attached | None
    ready: bool
    refused: str | None
    side_pools: dict[str, str]
    settings: BackendSettings
    link: SidecarLink
    _lock: threading.Lock

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
