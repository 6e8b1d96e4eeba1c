"""SGLang's v2 side-pool calls of `HicacheStorage` (`storage_backend`), and what one attach
holds: each pool moves on its own, as SGLang moves them. KV by `batch_*_v1` (the KV group
alone), the Mamba state by `batch_*_v2` with its one trailing key: stored under the state
group's key of that page id (per TP rank: every rank holds its own heads of the state, as
SGLang keys Mamba per rank), loaded alone into the host slot SGLang gives; an SWA window by
`batch_*_v2` with its trailing keys: its pages stored under the sliding group's keys, loaded
whole into SGLang's SWA host slots (a window short of a page is a miss, and so is a window
wider than the sidecar's sliding group keeps: its leading pages would never be written,
`side_pools.window_fits`). `batch_exists_v2` asks the sidecar which pages each group holds
and answers SGLang's hit policies and `restorable_prefix_pages` from them (`hit_policies`; a
window too wide for the sidecar: no length); a DSA model's indexer keys by `batch_*_v2` right
beside the KV's v1 call, as rows of the KV group's own pages (`index_pools`: the v1 call moved
them, `_beside_kv`). A side pool that is not mapped (DeepSeek-V4 pools, ...) or a transfer
that does not fit (a Mamba transfer of several keys, slots that do not match the keys) answers
no hit / not stored: SGLang recomputes. Like
the v1 calls, these never raise (`SidecarLink.use`), are bounded by the backend's timeouts,
and a repeated set stores nothing new (the sidecar holds those pages: True).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from hicache.client import Client, LoadHandle, PromptKeys
from hicache.integrations.core.load_end import UNENDED, end_load
from hicache.integrations.core.shared_memory import SharedRegions
from hicache.integrations.core.sidecar_link import SidecarLink
from hicache.integrations.sglang.hit_policies import PoolAsk, restorable
from hicache.integrations.sglang.host_pools import HostKv, host_pages
from hicache.integrations.sglang.index_pools import HostIndex, LastKvLoads
from hicache.integrations.sglang.settings import BackendSettings
from hicache.integrations.sglang.side_pools import HostState, host_slots, window_fits

log = logging.getLogger("hicache.sglang")


def pool_name(name: Any) -> str:
    """SGLang's pool name (a `PoolName` or its value) as its value: "kv", "mamba", ..."""
    return str(getattr(name, "value", name))


def policy_name(transfer: PoolTransfer) -> str:
    policy = transfer.hit_policy
    return str(getattr(policy, "value", policy))


class Attached:
    """What one attach holds: the shared host pool and the group it maps to; the side pools
    mapped (a Mamba pool's state group, an SWA pool's sliding group), one region under all."""

    def __init__(self, region: SharedRegions, host: HostKv, group: str, manifest: Any):
        self.region = region
        self.host = host
        self.group = group
        self.manifest = manifest  # the KV host buffer
        self.state: HostState | None = None
        self.state_group: str | None = None
        self.swa: HostKv | None = None
        self.swa_buffer: Any = None
        self.swa_group: str | None = None
        self.index: HostIndex | None = None  # a DSA model's indexer pool: rows of `group`
        # pools SGLang registered again after the attach: no longer the memory mapped here
        self.replaced: set[str] = set()

    def groups(self) -> dict[str, str]:
        """SGLang's pool names mapped, and the sidecar group each moves."""
        out = {"kv": self.group}
        if self.state_group is not None:
            out["mamba"] = self.state_group
        if self.swa_group is not None:
            out["swa"] = self.swa_group
        if self.index is not None:
            out["indexer"] = self.group  # its keys are rows of the KV's own pages
        return out

    def served(self) -> dict[str, str]:
        """`groups()` less the pools SGLang replaced after the attach (`replaced`)."""
        return {name: g for name, g in self.groups().items() if name not in self.replaced}

    def pages_of(self, group: str | None, pages: list[int | None]) -> dict[str, list[int | None]]:
        """A store's device pages: `pages` for `group`, none (None) for the other token
        groups (a store names every token group; SGLang stores each pool on its own; a
        state alone: `group` None)."""
        tokens = [self.group] + ([self.swa_group] if self.swa_group is not None else [])
        return {g: pages if g == group else [None] * len(pages) for g in tokens}

    def storages(self) -> list[Any]:
        """Every host buffer shared with the sidecar (one memfd under all)."""
        out = [self.manifest.untyped_storage()]
        if self.state is not None:
            out += [b.buffer.untyped_storage() for b in self.state.buffers]
        if self.swa_buffer is not None:
            out.append(self.swa_buffer.untyped_storage())
        if self.index is not None:
            out.append(self.index.buffer.untyped_storage())
        return out

    def reaches(self) -> list[tuple[int, int]]:
        """Per storage of `storages()` the addresses shared: the whole allocation, but for a
        DSA indexer buffer, the rows of the KV pool's pages (`HostIndex.reach`)."""
        index = None if self.index is None else self.index.buffer.untyped_storage().data_ptr()
        return [
            self.index.reach(self.host.pages)
            if self.index is not None and s.data_ptr() == index
            else (int(s.data_ptr()), int(s.data_ptr()) + int(s.nbytes()))
            for s in self.storages()
        ]


class SidePoolOps:
    """`HicacheStorage`'s v2 calls (see the module doc); the backend gives what they use."""

    attached: Attached | None
    ready: bool
    link: SidecarLink
    settings: BackendSettings
    recent: LastKvLoads  # per controller thread: its last KV load (`_beside_kv`)

    def live(self) -> Attached | None:
        """The attach the data path may use: None until SGLang registered every host pool
        (`on_host_pools_registered`) and after close()."""
        return self.attached if self.ready else None

    def _keys(self, client: Client, keys: Sequence[str]) -> PromptKeys:
        raise NotImplementedError

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        raise NotImplementedError

    # ---- v2: each pool on its own; the Mamba state by its trailing key (module doc) ------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        side = [t for t in pool_transfers or [] if pool_name(t.name) != "kv"]
        if not side:
            return PoolTransferResult(self.batch_exists(keys, extra_info), {})
        attached = self.live()
        if attached is None or not keys:
            return PoolTransferResult(0, {}, [])
        asks = [PoolAsk(pool_name(t.name), str(policy_name(t)), len(t.keys or ())) for t in side]
        groups = attached.served()
        if any(ask.name not in groups for ask in asks):  # a pool not mapped: no prefix whole
            return PoolTransferResult(0, {}, [])

        def ask(client: Client) -> PoolTransferResult:
            asked = list(dict.fromkeys(groups.values()))  # the indexer's group is the KV's
            served = client.served_keys(self._keys(client, keys), asked)
            kv_pages = served[attached.group].run  # a whole-prefix group: its run
            held = {name: set(served[group].lengths(kv_pages)) for name, group in groups.items()}
            for wide in self._wide_windows(client, asks):
                held[wide] = set()  # a window the sidecar does not keep whole: no length
            got = restorable(kv_pages, asks, held)
            return PoolTransferResult(got.kv_hit_pages, got.pool_hits, got.lengths)

        return self.link.use("batch_exists_v2", ask, PoolTransferResult(0, {}, []))

    def _end_load(self, client: Client, handle: LoadHandle, op: str) -> str:
        """A load's final state, waited for up to `load_timeout_s`, then cancelled and waited
        for as long again (`core.load_end`). SGLang frees the host slots of a load that
        answered False and reuses them at once, so a load that still did not end has its
        session detached (`SidecarLink.detach`: the sidecar registers this memory again only
        once that session's copies are over). Not confirmed over (the sidecar stuck in a copy
        for longer than that): logged as an error, the one case where a late write can still
        land in a reused slot."""
        timeout_s = self.settings.load_timeout_s
        state = end_load(handle, timeout_s, timeout_s)
        if state != UNENDED:
            return state
        why = (
            f"{op}: load {handle.load_id} did not end in {timeout_s:g} s, nor {timeout_s:g} s "
            "after it was cancelled; its session is detached so that none of its copies lands "
            "in host slots SGLang reuses"
        )
        if not self.link.detach(client, why):
            log.error(
                "hicache %s: %s, and the sidecar has not confirmed that session over: a late "
                "copy may still land in SGLang's host slots",
                self.link.name,
                why,
            )
        return state

    def _wide_windows(self, client: Client, asks: Sequence[PoolAsk]) -> list[str]:
        """The SWA asks whose window is wider than the sidecar's sliding group keeps
        (`side_pools.window_fits`): never restorable (logged, at most once per
        `retry_after_s`)."""
        attached = self.live()
        if attached is None or attached.swa_group is None or attached.swa is None:
            return []
        geometry = client.geometries[attached.swa_group]
        size = attached.swa.page_size
        wide = [a for a in asks if a.name == "swa" and not window_fits(geometry, a.window, size)]
        if wide:
            self._window_too_wide(wide[0].window)
        return [a.name for a in wide]

    def _window_too_wide(self, pages: int) -> None:
        attached = self.attached
        group = None if attached is None else attached.swa_group
        self.link.note(
            "swa window",
            f"hicache {self.link.name}: SGLang's SWA window of {pages} pages is wider than the "
            f"sidecar's sliding group {group!r} keeps (its window_tokens): such windows are "
            "not served (SGLang recomputes them); give the deployment the model's window",
        )

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2("batch_get_v1", self._load_state, self._load_window, transfers, extra_info)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(
            "batch_set_v1", self._store_state, self._store_window, transfers, extra_info
        )

    def _v2(
        self,
        v1: str,
        state_op: Any,
        window_op: Any,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None,
    ) -> dict[str, list[bool]]:
        out = {}
        for t in transfers:
            name = pool_name(t.name)
            keys = list(t.keys or [])
            if name == "kv" and t.host_indices is not None:
                out[name] = getattr(self, v1)(keys, t.host_indices, extra_info)
            elif name == "mamba" and len(keys) == 1:  # one state, at the span's trailing key
                out[name] = [bool(state_op(keys[0], t.host_indices))]
            elif name == "swa" and keys:  # the window's pages, at the span's trailing keys
                out[name] = [bool(window_op(keys, t.host_indices))] * len(keys)
            elif name == "indexer" and t.host_indices is not None:  # the KV's pages' rows
                out[name] = self._beside_kv(v1, keys, t.host_indices, extra_info)
            else:
                out[name] = [False] * len(keys)
        return out

    def _beside_kv(
        self, v1: str, keys: list[str], host_indices: Any, extra_info: Any
    ) -> list[bool]:
        """A DSA model's indexer keys, moved as rows of the KV's own pages (`index_pools`).
        SGLang sets them just before the KV's `batch_set_v1` (same keys, same host pages): the
        store moves the whole pages, and the KV's set then finds them held. It gets them just
        after the KV's `batch_get_v1` on the same thread: that load wrote these rows already,
        so its answer is this one's (taken once; any other call is a load of its own)."""
        attached = self.live()
        if attached is None or attached.index is None or "indexer" in attached.replaced:
            return [False] * len(keys)
        if v1 == "batch_get_v1":
            pages = host_pages(host_indices, attached.host.page_size, len(keys))
            loaded = self.recent.take(keys, pages)
            if loaded is not None:
                return [i < loaded for i in range(len(keys))]
        return list(getattr(self, v1)(keys, host_indices, extra_info))

    def _state_slot(self, host_indices: Any) -> tuple[Attached, str, int] | None:
        attached = self.live()
        slots = host_slots(host_indices, 1)
        if attached is None or attached.state_group is None or slots is None:
            return None
        if "mamba" in attached.replaced:
            return None
        return attached, attached.state_group, slots[0]

    def _store_state(self, key: str, host_indices: Any) -> bool:
        """The state in SGLang's host slot, stored under the state group's key of `key` (the
        page it follows): a one-key prompt whose KV page is not named (None)."""
        found = self._state_slot(host_indices)
        if found is None:
            return False
        attached, group, slot = found
        size = attached.host.page_size

        def store(client: Client) -> bool:
            reply = client.store_keys(
                self._keys(client, [key]), attached.pages_of(None, [None]), {group: {size: slot}}
            )
            return reply.get("truncated_to_tokens") is None

        return bool(self.link.use("batch_set_v2", store, False))

    def _load_state(self, key: str, host_indices: Any) -> bool:
        """The state stored under `key` into SGLang's host slot, the state group alone."""
        found = self._state_slot(host_indices)
        if found is None:
            return False
        _, group, slot = found

        def load(client: Client) -> bool:
            handle = client.load_keys(
                self._keys(client, [key]),
                {group: [slot]},
                groups=[group],
                l3_wait_s=self.settings.l3_wait_s,
            )
            if handle is None:
                return False
            return self._end_load(client, handle, "batch_get_v2") == "done"

        return bool(self.link.use("batch_get_v2", load, False))

    def _window_pages(
        self, keys: Sequence[str], host_indices: Any
    ) -> tuple[Attached, str, list[int]] | None:
        attached = self.live()
        if attached is None or attached.swa_group is None or attached.swa is None:
            return None
        if "swa" in attached.replaced:
            return None
        if host_indices is None:
            return None
        pages = host_pages(host_indices, attached.swa.page_size, len(keys))
        return None if pages is None else (attached, attached.swa_group, pages)

    def _store_window(self, keys: Sequence[str], host_indices: Any) -> bool:
        """An SWA window's pages in SGLang's SWA host pool, stored under the sliding group's
        keys of their page ids (the full group's pages not named: None); all or nothing."""
        found = self._window_pages(keys, host_indices)
        if found is None:
            return False
        attached, group, pages = found

        def store(client: Client) -> bool:
            reply = client.store_keys(self._keys(client, keys), attached.pages_of(group, [*pages]))
            return reply.get("truncated_to_tokens") is None

        return bool(self.link.use("batch_set_v2", store, False))

    def _load_window(self, keys: Sequence[str], host_indices: Any) -> bool:
        """An SWA window's pages into SGLang's SWA host slots, the sliding group alone; True
        only when every page of the window landed (a shorter one is SGLang's miss)."""
        found = self._window_pages(keys, host_indices)
        if found is None:
            return False
        attached, group, pages = found
        size = attached.host.page_size

        def load(client: Client) -> bool:
            if not window_fits(client.geometries[group], len(keys), size):
                self._window_too_wide(len(keys))  # its leading pages would not be written
                return False
            handle = client.load_keys(
                self._keys(client, keys),
                {group: pages},
                groups=[group],
                l3_wait_s=self.settings.l3_wait_s,
            )
            if handle is None:
                return False
            ended = self._end_load(client, handle, "batch_get_v2")  # its pins go
            return ended == "done" and handle.tokens == len(keys) * size

        return bool(self.link.use("batch_get_v2", load, False))
