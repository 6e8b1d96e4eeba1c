"""`HicacheLinker`: SGLang's `UnifiedCacheLinker` (0.5.23's "direct L3" plug-in) with hicache
as the host tier. SGLang keeps its radix tree, admission and device slots; the linker answers
which prefixes the sidecar can restore, streams a hit layer by layer into SGLang's device pool,
and stores what SGLang offloads. Every engine on the host attached to one sidecar shares what
any of them stored.

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "HicacheLinker",
        "linker_module_path": "hicache.integrations.sglang.linker",
        "linker_extra_config": {"config": "deploy.yaml"}}'

Translation (pure parts in `linker_keys`, `linker_pool`, `linker_components`, `linker_state`):
- pages are named by SGLang's page hashes, keyed in the sidecar's namespace
  (`keys_of_hashes`, as the storage backend keys them) and sent as the keyed ops
  (`store_keys` / `load_keys`); SGLang's device slots become page ids;
- `lookup` -> `lookup_keys`; every length up to the hit is restorable (full attention);
  with side pools in the call, `served_keys` of every group and SGLang's trailing rule
  (`hit_policies.restorable`): a length is restorable when the full group holds every page
  up to it, the sliding group the window's pages before it, the state group a state after it;
- `load` starts the sidecar's load at once, into the request's private slots: a load the
  sidecar cannot serve whole (pages gone, L3 fetch late) is refused here, so SGLang recomputes
  the request (a refused `load` is its recompute path; a load failing after its forward
  started is reported by `finish_layer_wise_loading`, and SGLang then aborts the request);
- `start_layer_wise_loading` completes SGLang's `LayerWiseLoadCounter` layer by layer from
  hicache's own per-layer counters (`LoadHandle.wait_layer`), on the linker's load thread;
- `offload` is queued to the store thread, one completion per offload, in order.

Per-load lifecycle:
    load(): a sidecar load per pool started -> queued   (refused: every one it started ended
                                                          and released, SGLang recomputes)
    queued --cancel_queued_load--> each waited to its end, dropped (SGLang frees the slots)
    queued --start_layer_wise_loading--> streaming (counter index i; layers complete in order)
    streaming --every layer landed (each from its pool's load)--> landed;
              --a layer failed or timed out--> failed
    landed | failed --> its sidecar slot released; finish_layer_wise_loading(i) reports which
Per-offload: offload() queued -> stored | not stored (sidecar down, refused) -> popped.
`reset` and `close` wait for every started load and queued offload to end first.

Faults: nothing raises into SGLang's data path. The session with the sidecar is the
integration core's `SidecarLink` (as the storage backend's): a sidecar down answers no hits and
stores nothing (one warning per outage), and is tried again after `retry_after_s`; a call the
sidecar refuses answers no hit / not stored and leaves the session up; a load that cannot be
confirmed stopped (`LoadHandle.done` failed or timed out) drops the session (`SidecarLink.drop`:
the client closed, so the sidecar ends that session's loads).
Components (`linker_components`): FULL (SGLang's pool "kv", the sidecar's full group), SWA
("swa": an `SWAKVPool`'s sliding pool, the sidecar's sliding group) and MAMBA ("mamba":
`req_to_token_pool.mamba_pool`, the sidecar's state group; the linker's counter is registered
with `req_to_token_pool`, where the Mamba layers wait). Each transfer of a call moves on its
own: a load is one sidecar load per pool in it (a load may carry only the SWA window or the
state, SGLang having the full pages on the device already), each pool's layers waited on by
the load thread, and the counter completes every model layer in order; an offload stores each
pool's pages under its keys (a state as the snapshot after its page, under that page's key),
the other groups' pages not named. A pool that does not fit the sidecar's group is refused
by name at construction (`PoolShapeError`).
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
from hicache.errors import PoolShapeError
from hicache.integrations.core.sidecar_link import SidecarLink
from hicache.integrations.sglang.hit_policies import TRAILING_PAGES, PoolAsk, restorable
from hicache.integrations.sglang.linker_components import KV, MAMBA, Component, LinkedPools
from hicache.integrations.sglang.linker_keys import keys_of_hashes, restorable_lengths
from hicache.integrations.sglang.linker_pool import KvTensors, page_ids
from hicache.integrations.sglang.linker_settings import LinkerSettings, layer_map_of
from hicache.integrations.sglang.linker_state import state_slot
from hicache.memory import CacheDtypes, group_geometries
from hicache.memory.geometry import dtype_name

log = logging.getLogger("hicache.sglang")


@dataclass
class _Load:
    """One pool's sidecar load of a request."""

    rid: str
    handle: LoadHandle
    client: Client
    layer_ids: frozenset[int]


_Offload = tuple[list[tuple[str, list[str], list[int]]], list[Any]]  # per pool; CUDA events


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
        self.page_size = int(params.page_size)
        mamba_pool = None
        if ComponentType.MAMBA in set(components):
            mamba_pool = getattr(params.req_to_token_pool, "mamba_pool", None)
            if mamba_pool is None:
                raise PoolShapeError(
                    f"SGLang's tree has a MAMBA component but its req_to_token_pool "
                    f"({type(params.req_to_token_pool).__name__}) has no mamba_pool"
                )
        tp_size = int(getattr(server_args, "tp_size", 1) or 1)
        self.layer_map = layer_map_of(str(server_args.model_path), tp_size)
        first = KvTensors.of(getattr(self.kv, "full_kv_pool", self.kv)).k[0]
        dtype = dtype_name(first.dtype)
        state_dtype = ssm_dtype = None  # a Mamba pool's: conv, temporal (as SGLang keeps them)
        if mamba_pool is not None:
            cache = mamba_pool.mamba_cache
            state_dtype, ssm_dtype = (
                dtype_name(cache.conv[0].dtype),
                dtype_name(cache.temporal.dtype),
            )
        geometries = group_geometries(
            self.layer_map.groups,
            CacheDtypes.from_names(dtype, state_dtype, ssm_dtype),
            self.page_size,
        )
        self.cuda = first.device.type == "cuda"
        self.linked = LinkedPools.of(self.kv, geometries, cuda=self.cuda, mamba_pool=mamba_pool)
        self.components: dict[str, Component] = self.linked.components
        self.pools = {PoolName(name): c.sglang_pool for name, c in self.components.items()}
        self.layer_done_counter = LayerWiseLoadCounter(self.linked.num_layers)
        if (
            mamba_pool is not None
        ):  # the Mamba layers wait on it there (SGLang registers the KV pool's)
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)
        rank = _tp_rank() if tp_size > 1 else 0
        self.link = SidecarLink(
            lambda: Client(
                self.settings.address,
                self.layer_map,
                dtype=dtype,
                state_dtype=state_dtype,
                ssm_state_dtype=ssm_dtype,
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
        self._queued: dict[str, list[_Load]] = {}
        self._batches: queue.Queue[_Batch | None] = queue.Queue()
        self._started: list[_Batch] = []
        self._offloads: queue.Queue[_Offload | None] = queue.Queue()
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
        self.linked.register(client)

    # ---- lookup -----------------------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        by_pool = _by_pool(transfers)
        kv = by_pool.pop(KV, None)
        if kv is None or not kv.keys or set(by_pool) - set(self.components):
            return []
        if not by_pool:  # full attention alone: the hit's leading run
            hit = self.link.use(
                "lookup", lambda c: c.lookup_keys(keys_of_hashes(c.key_spec(), kv.keys)), None
            )
            if hit is None:
                return []
            return restorable_lengths(hit.tokens_total, self.page_size, len(kv.keys))
        # side pools: SGLang's trailing rule over what each group serves (the SWA window is
        # its transfer's keys; a Mamba state is one key: the state after that page)
        asks = [PoolAsk(name, TRAILING_PAGES, len(t.keys or ())) for name, t in by_pool.items()]
        groups = {name: self.components[name].group for name in (KV, *by_pool)}

        def ask(client: Client) -> list[int]:
            keys = keys_of_hashes(client.key_spec(), kv.keys)
            served = client.served_keys(keys, list(groups.values()))
            run = min(served[groups[KV]].run, len(kv.keys))
            held = {name: set(served[groups[name]].lengths(run)) for name in by_pool}
            return restorable(run, asks, held).lengths

        return list(self.link.use("lookup", ask, []))

    # ---- load -------------------------------------------------------------------------------

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        """One sidecar load per pool in `transfers` (SGLang may send the SWA window alone);
        all started and whole, or none kept (SGLang recomputes)."""
        by_pool = _by_pool(transfers)
        if not by_pool or set(by_pool) - set(self.components) or rid in self._queued:
            return False
        planned = []
        for name, transfer in by_pool.items():
            pages = None
            if transfer.keys and transfer.device_indices is not None:
                pages = self._pages(name, transfer.device_indices)
            if pages is None or len(pages) != len(transfer.keys):
                log.warning(
                    "hicache: load %s: %s slots are not whole pages; recomputing", rid, name
                )
                return False
            planned.append((self.components[name], list(transfer.keys), pages))
        loads: list[_Load] = []
        for component, hashes, pages in planned:
            load = self._start_load(rid, component, hashes, pages)
            if load is None:
                for started in loads:
                    self._end(started)
                return False
            loads.append(load)
        self._queued[rid] = loads
        return True

    def _pages(self, pool: str, device_indices: Any) -> list[int] | None:
        """A transfer's device slots as the group's pages: token slots of whole pages, or
        (MAMBA) the state's one slot."""
        if pool != MAMBA:
            return page_ids(device_indices, self.page_size)
        return state_slot(device_indices)

    def _start_load(
        self, rid: str, component: Component, hashes: list[str], pages: list[int]
    ) -> _Load | None:
        """The component's pages loading, whole; None (nothing left pinned) otherwise."""
        groups = [component.group] if len(self.components) > 1 else None

        def start(client: Client) -> tuple[_Load, int] | None:
            keys = keys_of_hashes(client.key_spec(), hashes)
            handle = client.load_keys(
                keys, {component.group: pages}, stream=self._stream(), groups=groups
            )
            if handle is None:
                return None
            return _Load(rid, handle, client, frozenset(component.layer_ids)), keys.num_tokens

        started = self.link.use("load", start, None)
        if started is None:
            return None
        load, tokens_asked = started
        if load.handle.tokens < tokens_asked:  # part of the hit is gone: recompute it all
            self._end(load)
            return None
        return load

    def cancel_queued_load(self, rid: str) -> bool:
        loads = self._queued.pop(rid, None)
        if loads is None:
            return False
        for load in loads:  # they already write the request's slots: wait until they stopped
            self._end(load)
        return True

    def start_layer_wise_loading(self) -> int:
        if not self._queued:
            return -1
        loads = [load for queued in self._queued.values() for load in queued]
        self._queued = {}
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
        for layer_id in range(counter.num_layers):  # every layer, from the pool holding it
            try:
                for load in batch.loads:
                    if layer_id in load.layer_ids:
                        load.handle.wait_layer(layer_id, timeout_s=self.settings.load_timeout_s)
            except Exception as exc:
                log.warning("hicache: load failed at layer %d (%s)", layer_id, exc)
                counter.fail(batch.index, exc)
                return
            counter.complete(batch.index, layer_id)

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
        by_pool = _by_pool(transfers)
        if not by_pool or set(by_pool) - set(self.components):
            return False
        stores = []
        for name, transfer in by_pool.items():
            if not transfer.keys or transfer.device_indices is None:
                return False
            pages = self._pages(name, transfer.device_indices)
            if pages is None or len(pages) != len(transfer.keys):
                return False
            stores.append((name, list(transfer.keys), pages))
        events = self.record_offload_ready() if self.cuda else []
        with self._offload_idle:
            self._offloads_pending += 1
        self._offloads.put((stores, events))
        return True

    def _offload_thread(self) -> None:
        while (item := self._offloads.get()) is not None:
            stores, events = item
            for event in events:  # CUDA: the copies wait for the forward that wrote the pages
                self._stream().wait_event(event)
            stored = all([self._store(*store) for store in stores])  # each pool tried
            with self._offload_idle:
                self._completed.append(stored)
                self._offloads_pending -= 1
                self._offload_idle.notify_all()

    def _store(self, pool: str, hashes: list[str], pages: list[int]) -> bool:
        """The pool's pages under their keys, the other groups' pages not named."""

        snapshots = None
        if pool == MAMBA:  # the state after the key's page, filed under that key
            snapshots = {self.components[MAMBA].group: {self.page_size: pages[0]}}

        def store(client: Client) -> bool:
            keys = keys_of_hashes(client.key_spec(), hashes)
            reply = client.store_keys(  # a state names no token group's page
                keys, self.linked.pages_of(pool, pages), snapshots, stream=self._stream()
            )
            return reply.get("truncated_to_tokens") is None

        return bool(self.link.use("store", store, False))

    def num_completed_offloads(self) -> int:
        return len(self._completed)

    def pop_completed_offload(self) -> bool:
        return bool(self._completed.popleft())

    # ---- lifecycle --------------------------------------------------------------------------

    def _stream(self) -> Any:
        """CUDA: this thread's current stream on the pool's device (`hicache.transfer`, the
        one package that calls into CUDA); CPU: None."""
        if not self.cuda:
            return None
        from hicache.transfer.cuda_ipc import current_stream  # CUDA only when used

        return current_stream(self.components[KV].tensors.all_tensors()[0].device)

    def _quiesce(self) -> None:
        for loads in list(self._queued.values()):
            for load in loads:
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
        self.linked.close()


def _by_pool(transfers: list[PoolTransfer]) -> dict[str, PoolTransfer]:
    """The call's transfers by SGLang pool name ("kv", "swa", ...)."""
    return {str(getattr(t.name, "value", t.name)): t for t in transfers}


def _tp_rank() -> int:
    from sglang.srt.distributed import (  # type: ignore[import-not-found,unused-ignore]
        get_tensor_model_parallel_rank,
    )

    return int(get_tensor_model_parallel_rank())
