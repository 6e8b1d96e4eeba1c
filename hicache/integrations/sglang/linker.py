"""`HicacheLinker`: SGLang's `UnifiedCacheLinker` (0.5.23's "direct L3" plug-in) with hicache
as the host tier. SGLang keeps its radix tree, admission and device slots; the linker answers
which prefixes the sidecar can restore, streams a hit layer by layer into SGLang's device pool,
and stores what SGLang offloads. Every engine on the host attached to one sidecar shares what
any of them stored.

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "HicacheLinker",
        "linker_module_path": "hicache.integrations.sglang.linker",
        "linker_extra_config": {"config": "deploy.yaml"}}'

Translation (pure parts in `linker_keys` and `linker_pool`):
- pages are named by SGLang's page hashes, keyed in the sidecar's namespace
  (`keys_of_hashes`, as the storage backend keys them) and sent as the keyed ops
  (`store_keys` / `load_keys`); SGLang's device slots become page ids;
- `lookup` -> `lookup_keys`; every length up to the hit is restorable (full attention);
- `load` starts the sidecar's load at once, into the request's private slots: a load the
  sidecar cannot serve whole (pages gone, L3 fetch late) is refused here, so SGLang recomputes
  the request (a refused `load` is its recompute path; a load failing after its forward
  started is reported by `finish_layer_wise_loading`, and SGLang then aborts the request);
- `start_layer_wise_loading` completes SGLang's `LayerWiseLoadCounter` layer by layer from
  hicache's own per-layer counters (`LoadHandle.wait_layer`), on the linker's load thread;
- `offload` is queued to the store thread, one completion per offload, in order.

Per-load lifecycle:
    load(): sidecar load started -> queued        (refused: nothing started, SGLang recomputes)
    queued --cancel_queued_load--> waited to its end, dropped (SGLang frees the slots)
    queued --start_layer_wise_loading--> streaming (counter index i; layers complete in order)
    streaming --every layer landed--> landed; --a layer failed or timed out--> failed
    landed | failed --> its sidecar slot released; finish_layer_wise_loading(i) reports which
Per-offload: offload() queued -> stored | not stored (sidecar down, refused) -> popped.
`reset` and `close` wait for every started load and queued offload to end first.

Faults: nothing raises into SGLang's data path. The session with the sidecar is the
integration core's `SidecarLink` (as the storage backend's): a sidecar down answers no hits and
stores nothing (one warning per outage), and is tried again after `retry_after_s`; a call the
sidecar refuses answers no hit / not stored and leaves the session up; a load that cannot be
confirmed stopped (`LoadHandle.done` failed or timed out) drops the session (`SidecarLink.drop`:
the client closed, so the sidecar ends that session's loads).
Components: FULL. A model with SWA or Mamba components attaches, but the linker answers no
hits and stores nothing (logged once): those pools are not moved yet.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

# sglang is not installed where CI runs mypy (the main venv): its names are Any there
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found,unused-ignore]
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.unified_cache.component_type import (  # type: ignore[import-not-found,unused-ignore]
    ComponentType,
)
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (  # type: ignore[import-not-found,unused-ignore]
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)

from hicache.client import Client, LoadHandle
from hicache.integrations.core.sidecar_link import SidecarLink
from hicache.integrations.sglang.linker_keys import keys_of_hashes, restorable_lengths
from hicache.integrations.sglang.linker_pool import (
    KvTensors,
    geometry_of,
    page_ids,
    share_kv,
)
from hicache.integrations.sglang.linker_settings import LinkerSettings, layer_map_of
from hicache.memory import CacheDtypes, group_geometries
from hicache.memory.geometry import dtype_name

log = logging.getLogger("hicache.sglang")


@dataclass
class _Load:
    rid: str
    handle: LoadHandle
    client: Client


@dataclass
class _Batch:
    index: int
    loads: list[_Load]
    ended: threading.Event = field(default_factory=threading.Event)


class HicacheLinker(UnifiedCacheLinker):  # type: ignore[misc,unused-ignore]
    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: Any,
        extra_config: dict[str, Any] | None = None,
        forward_stream: Any = None,
    ):
        self.forward_stream = forward_stream
        self.settings = LinkerSettings.parse(extra_config)
        self.kv = params.token_to_kv_pool_allocator.get_kvcache()
        self.pools = {PoolName.KV: self.kv}
        self.layer_done_counter = LayerWiseLoadCounter(self.kv.layer_num)
        self.page_size = int(params.page_size)
        others = sorted(str(c) for c in set(components) - {ComponentType.FULL})
        self.unsupported = (
            f"components {others} are not moved by the hicache linker yet" if others else None
        )
        if self.unsupported:
            log.warning("hicache: %s; it answers no hits and stores nothing", self.unsupported)
        tp_size = int(getattr(server_args, "tp_size", 1) or 1)
        self.layer_map = layer_map_of(str(server_args.model_path), tp_size)
        self.tensors = KvTensors.of(self.kv)
        dtype = dtype_name(self.tensors.k[0].dtype)
        geometries = group_geometries(
            self.layer_map.groups, CacheDtypes.from_names(dtype), self.page_size
        )
        self.geometry = geometry_of(geometries)
        self.tensors.check(self.geometry)
        self.group = self.geometry.group.name
        self.layer_ids = list(self.geometry.group.layer_ids)
        self.cuda = self.tensors.k[0].device.type == "cuda"
        self.memory = None
        if not self.cuda:
            self.memory, how = share_kv(self.tensors, self.kv)
            self.tensors = KvTensors.of(self.kv)  # rebacked: the pool's new tensors
            log.info("hicache: SGLang's KV pool shared with the sidecar %s", how)
        rank = _tp_rank() if tp_size > 1 else 0
        self.link = SidecarLink(
            lambda: Client(
                self.settings.address,
                self.layer_map,
                dtype=dtype,
                page_size_tokens=self.page_size,
                tp_rank=rank,
                tenant=self.settings.tenant,
                token=self.settings.token,
                engine="sglang",
                timeout_s=max(5.0, self.settings.load_timeout_s),
            ),
            self._register,
            retry_after_s=self.settings.retry_after_s,
            name=f"sglang linker rank {rank}",
            log=log,
        )
        self._queued: dict[str, _Load] = {}
        self._batches: queue.Queue[_Batch | None] = queue.Queue()
        self._started: list[_Batch] = []
        self._offloads: queue.Queue[tuple[list[str], list[int], list[Any]] | None] = queue.Queue()
        self._completed: collections.deque[bool] = collections.deque()
        self._offloads_pending = 0
        self._offload_idle = threading.Condition()
        self._threads = [
            threading.Thread(target=self._load_thread, name="hicache-linker-load", daemon=True),
            threading.Thread(
                target=self._offload_thread, name="hicache-linker-offload", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()
        self.link.client()  # attach now when the sidecar is up (else at the next use)

    def _register(self, client: Client) -> None:
        if self.cuda:
            client.register_cuda_pools(self.tensors.device_pools(self.geometry))
        else:
            assert self.memory is not None
            client.register_pools(self.tensors.shared_pools(self.memory, self.geometry))

    # ---- lookup -----------------------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = _kv_transfer(transfers)
        if self.unsupported or kv is None or not kv.keys:
            return []
        hit = self.link.use(
            "lookup", lambda c: c.lookup_keys(keys_of_hashes(c.key_spec(), kv.keys)), None
        )
        if hit is None:
            return []
        return restorable_lengths(hit.tokens_total, self.page_size, len(kv.keys))

    # ---- load -------------------------------------------------------------------------------

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        kv = _kv_transfer(transfers)
        if self.unsupported or kv is None or not kv.keys or kv.device_indices is None:
            return False
        pages = page_ids(kv.device_indices, self.page_size)
        if pages is None or len(pages) != len(kv.keys):
            log.warning("hicache: load %s: device slots are not whole pages; recomputing", rid)
            return False

        def start(client: Client) -> tuple[_Load, int] | None:
            keys = keys_of_hashes(client.key_spec(), kv.keys)
            handle = client.load_keys(keys, {self.group: pages}, stream=self._stream())
            return None if handle is None else (_Load(rid, handle, client), keys.num_tokens)

        started = self.link.use("load", start, None)
        if started is None:
            return False
        load, tokens_asked = started
        if load.handle.tokens < tokens_asked:  # part of the hit is gone: recompute it all
            self._end(load)
            return False
        self._queued[rid] = load
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        load = self._queued.pop(rid, None)
        if load is None:
            return False
        self._end(load)  # it already writes the request's slots: wait until it stopped
        return True

    def start_layer_wise_loading(self) -> int:
        if not self._queued:
            return -1
        loads, self._queued = list(self._queued.values()), {}
        batch = _Batch(self.layer_done_counter.update_producer(), loads)
        self._started.append(batch)
        self._batches.put(batch)
        return batch.index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        landed = bool(self.layer_done_counter.finish(counter_index))
        for batch in [b for b in self._started if b.index == counter_index]:
            batch.ended.wait()
            self._started.remove(batch)
        return landed

    def _load_thread(self) -> None:
        while (batch := self._batches.get()) is not None:
            try:
                self._stream_batch(batch)
            finally:
                for load in batch.loads:
                    self._end(load)
                batch.ended.set()

    def _stream_batch(self, batch: _Batch) -> None:
        counter = self.layer_done_counter
        for index, layer_id in enumerate(self.layer_ids):
            try:
                for load in batch.loads:
                    load.handle.wait_layer(layer_id, timeout_s=self.settings.load_timeout_s)
            except Exception as exc:
                log.warning("hicache: load failed at layer %d (%s)", layer_id, exc)
                counter.fail(batch.index, exc)
                return
            counter.complete(batch.index, index)

    def _end(self, load: _Load) -> None:
        """Wait for the load to stop writing, and free its sidecar slot."""
        try:
            load.handle.done(timeout_s=self.settings.load_timeout_s)
        except Exception as exc:  # lost or stuck: the session goes, and its loads with it
            self.link.drop(
                load.client, f"load {load.rid} did not end ({type(exc).__name__}: {exc})"
            )

    # ---- offload ----------------------------------------------------------------------------

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        kv = _kv_transfer(transfers)
        if self.unsupported or kv is None or not kv.keys or kv.device_indices is None:
            return False
        pages = page_ids(kv.device_indices, self.page_size)
        if pages is None or len(pages) != len(kv.keys):
            return False
        events = self.record_offload_ready() if self.cuda else []
        with self._offload_idle:
            self._offloads_pending += 1
        self._offloads.put((list(kv.keys), pages, events))
        return True

    def _offload_thread(self) -> None:
        while (item := self._offloads.get()) is not None:
            hashes, pages, events = item
            stored = self._store(hashes, pages, events)
            with self._offload_idle:
                self._completed.append(stored)
                self._offloads_pending -= 1
                self._offload_idle.notify_all()

    def _store(self, hashes: list[str], pages: list[int], events: list[Any]) -> bool:
        for event in events:  # CUDA: the copies wait for the forward that wrote the pages
            self._stream().wait_event(event)

        def store(client: Client) -> bool:
            keys = keys_of_hashes(client.key_spec(), hashes)
            client.store_keys(keys, {self.group: pages}, stream=self._stream())
            return True

        return bool(self.link.use("store", store, False))

    def num_completed_offloads(self) -> int:
        return len(self._completed)

    def pop_completed_offload(self) -> bool:
        return bool(self._completed.popleft())

    # ---- lifecycle --------------------------------------------------------------------------

    def _stream(self) -> Any:
        """CUDA: this thread's current stream on the pool's device (`hicache.transfer`, the
        one package that touches `torch.cuda`); CPU: None."""
        if not self.cuda:
            return None
        from hicache.transfer.cuda_ipc import current_stream  # CUDA only when used

        return current_stream(self.tensors.k[0].device)

    def _quiesce(self) -> None:
        for load in list(self._queued.values()):
            self._end(load)
        self._queued.clear()
        for batch in list(self._started):
            batch.ended.wait()
        self._started.clear()
        with self._offload_idle:
            self._offload_idle.wait_for(lambda: self._offloads_pending == 0)

    def reset(self) -> None:
        self._quiesce()
        self.layer_done_counter.reset()
        self._completed.clear()

    def close(self) -> None:
        self._quiesce()
        self._batches.put(None)
        self._offloads.put(None)
        for thread in self._threads:
            thread.join(timeout=self.settings.load_timeout_s)
        self.link.close()
        if self.memory is not None:
            self.memory.close()


def _kv_transfer(transfers: list[PoolTransfer]) -> PoolTransfer | None:
    return next((t for t in transfers if t.name == PoolName.KV), None)


def _tp_rank() -> int:
    from sglang.srt.distributed import (  # type: ignore[import-not-found,unused-ignore]
        get_tensor_model_parallel_rank,
    )

    return int(get_tensor_model_parallel_rank())
