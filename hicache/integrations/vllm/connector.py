"""`HicacheConnector`: hicache as a vLLM v1 KV connector (vLLM 0.32; `pip install hicache[vllm]`).

    LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="HicacheConnector",
        kv_connector_module_path="hicache.integrations.vllm",
        kv_role="kv_both",     # or kv_producer / kv_consumer: prefill and decode (roles.py)
        kv_connector_extra_config={"config": "deploy.yaml"}))

vLLM makes one connector per process and role. The scheduler role (EngineCore) asks a running
`hicache serve` how much of each new prompt it holds, through a lookup-only session — by page
keys it computes once per request with the sidecar's keyers and extends as the request grows
(`lookup_keys`; a sidecar without them is asked by tokens) — and plans each step's loads and
stores (`vllm/plan.py`); the worker role (Worker) binds vLLM's KV tensors
(`vllm/binding.py`) and registers vLLM's own blocks with the sidecar, which copies between L2
and them (`vllm/shared_kv.py`; a staging pool where it cannot, `vllm/worker.py`). The two
halves share nothing but vLLM's per-step metadata, so they work the same in vLLM's
multi-process mode and with VLLM_ENABLE_V1_MULTIPROCESSING=0.

Extra config keys (`kv_connector_extra_config`):
    config          the sidecar's deploy.yaml: its socket (or TCP port) and token
    address         instead of `config`: a Unix socket path or tcp://host:port
    token           the sidecar's service.token (default: from `config`)
    tenant          hicache namespace; default "vllm-<platform>-<attention isa>" since pages
                    hold vLLM's packed block bytes, which differ per backend and ISA
    load_timeout_s  how long one layer may take to land before the load is recomputed (10)
    staging_pages   copy through a staging pool of this many pages per token group instead
                    of the sidecar copying straight into vLLM's blocks (where it can)
    retry_after_s   wait between reconnect attempts while the sidecar is down (1)
    load_mode       auto (layerwise for one KV-cache group, else async), layerwise, async,
                    whole (the forward starts once every layer landed: no overlap)
    stats_path      the worker writes its counters (loads, failures, pages, seconds) here
                    as JSON after each step that moved pages; at tensor_parallel_size > 1
                    each rank to PATH with .rank<r> before its suffix; the scheduler half
                    its lookups' waits for stores in flight to PATH with .scheduler
    store_wait_s    how long a request waits for pages another engine's store in flight is
                    writing (0 to 60; default: 2 for kv_consumer, else 0; `vllm/roles.py`):
                    vLLM asks again at later steps meanwhile (`vllm/lookups.py`)
    persisted_within_s  kv_producer: each store answered once L3 holds its pages, at most
                    this long (0: at L2); for a decode instance on another host

`kv_role` (`vllm/roles.py`): kv_both loads and stores; kv_producer (a prefill instance) stores
every complete page of each prompt and ends each step once the sidecar acknowledged its
stores; kv_consumer (a decode instance) loads, waits for its prefill's store, never stores.

With vLLM's `kv_events_config` on, what hicache stored goes out on vLLM's own KV-event
channel too (`vllm/kv_events.py`).

Failures never reach vLLM as exceptions: a sidecar that is down gives no hits and skips
stores; a load that fails is reported with `get_block_ids_with_load_errors`, so vLLM
recomputes those blocks instead of serving them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import MambaSpec

from hicache.client import Client
from hicache.errors import ConfigError
from hicache.integrations.core.shared_memory import SharedRegions
from hicache.integrations.vllm.binding import StateSpec, bind_layers
from hicache.integrations.vllm.kv_events import (
    SchedulerEvents,
    WorkerEvents,
    events_enabled,
)
from hicache.integrations.vllm.layout import (
    async_loads_of,
    cacheable,
    default_tenant,
    layer_map_of,
    state_load_block,
    state_store_block,
    token_block_size,
)
from hicache.integrations.vllm.lookups import Lookups
from hicache.integrations.vllm.plan import Scheduled, StepBook, StepMeta
from hicache.integrations.vllm.roles import check_persisted, reply_timeout_s, role_of
from hicache.integrations.vllm.settings import ConnectorSettings
from hicache.integrations.vllm.shared_kv import data_plane
from hicache.integrations.vllm.worker import WorkerSide
from hicache.memory import CacheDtypes, group_geometries
from hicache.memory.geometry import dtype_name

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class HicacheConnectorMetadata(KVConnectorMetadata):
    def __init__(self, step: StepMeta):
        self.step = step


class HicacheConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        if kv_cache_config is None:
            raise ConfigError("HicacheConnector needs vLLM >= 0.32 (it passes kv_cache_config)")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError(
                f"HicacheConnector: pipeline_parallel_size={parallel.pipeline_parallel_size}; "
                "this connector supports 1 so far (tensor parallel: any size the sidecar's "
                "model.tp_size serves)"
            )
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            # context parallel splits a request's KV by token across ranks: an MLA latent
            # (stored once for every rank) would then differ per rank
            if int(getattr(parallel, name, 1) or 1) != 1:
                raise ConfigError(
                    f"HicacheConnector: {name}={getattr(parallel, name)}; context parallel "
                    "splits each request's KV across ranks by token, which hicache does not "
                    "key yet; allowed: 1"
                )
        self.kv_role = role_of(self._kv_transfer_config.kv_role)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.settings = ConnectorSettings.parse(extra)
        self.store_wait_s = (
            self.kv_role.default_store_wait_s
            if self.settings.store_wait_s is None
            else self.settings.store_wait_s
        )
        check_persisted(self.kv_role, self.settings.persisted_within_s)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            raise ConfigError(
                f"KVTransferConfig.kv_load_failure_policy is {policy!r}: a hicache load that "
                "fails (sidecar restarted, an L3 object corrupt) would fail the request; set "
                "kv_load_failure_policy='recompute' so vLLM recomputes those tokens instead"
            )
        self.async_loads = async_loads_of(self.settings.load_mode, kv_cache_config)
        self.layer_map = layer_map_of(vllm_config)
        self.page = token_block_size(kv_cache_config)
        self.tenant = self.settings.tenant or default_tenant(kv_cache_config)
        self._client_args = self._client_kwargs(vllm_config, kv_cache_config)
        self._engine_id = str(self._kv_transfer_config.engine_id or "")
        self._max_model_len = int(vllm_config.model_config.max_model_len)
        self._max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        # vLLM publishes KV events: hicache's stores go out on its channel (`vllm/kv_events.py`)
        self.kv_events = events_enabled(vllm_config, len(kv_cache_config.kv_cache_groups))
        if role == KVConnectorRole.SCHEDULER:
            self.events = SchedulerEvents(self.layer_map.layout.tp_size)
            self._requests: dict[str, Request] = {}
            self._local: dict[str, int] = {}
            self._failed_loads: set[str] = set()
            self.lookups = Lookups(
                lambda: self._connect("lookup"),
                self.settings.retry_after_s,
                wait_stored_s=self.store_wait_s,
            )
            self.book = StepBook(
                self.page,
                self.lookups.lookup,
                async_loads=self.async_loads,
                stores=self.kv_role.stores,
            )
        else:
            self.worker: WorkerSide | None = None
            self._layer_ids: dict[str, int] = {}
            self._shared_kv: SharedRegions | None = None
            self.worker_events = WorkerEvents(self.page) if self.kv_events else None

    def _client_kwargs(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
    ) -> dict[str, Any]:
        dtype = vllm_config.model_config.dtype
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"vLLM's model dtype is {dtype!r}, not resolved to a torch dtype")
        cache_dtype = vllm_config.cache_config.cache_dtype
        kv_dtype = dtype_name(dtype) if cache_dtype in (None, "auto") else str(cache_dtype)
        state_dtypes: list[torch.dtype] = []
        for group in kv_cache_config.kv_cache_groups:
            if isinstance(group.kv_cache_spec, MambaSpec):
                state_dtypes = list(group.kv_cache_spec.dtypes)
                break
        return {
            "dtype": kv_dtype,
            "page_size_tokens": self.page,
            "tenant": self.tenant,
            "token": self.settings.token,
            "state_dtype": dtype_name(state_dtypes[0]) if state_dtypes else None,
            "ssm_state_dtype": dtype_name(state_dtypes[-1]) if len(state_dtypes) > 1 else None,
        }

    def _connect(self, role: str) -> Client:
        # the worker half is one tensor-parallel rank, caching its share of the heads; the
        # scheduler half looks up in rank 0's namespace (every rank stores each step's pages,
        # and a rank that misses fails its load, which vLLM recomputes)
        return Client(
            self.settings.address,
            self.layer_map,
            role=role,
            tp_rank=self._worker_rank() if role == "engine" else 0,
            # both halves of one vLLM engine name it alike: a lookup session answers only
            # for the namespace its own engine's worker holds
            engine=f"vllm:{self._engine_id}",
            # a reply may wait for a store in flight, or for L3: each role's timeout
            # outlasts the waits its own requests carry
            timeout_s=reply_timeout_s(
                role,
                load_timeout_s=self.settings.load_timeout_s,
                store_wait_s=self.store_wait_s,
                persisted_within_s=self.settings.persisted_within_s,
            ),
            **self._client_args,
        )

    def _worker_rank(self) -> int:
        """This worker's tensor-parallel rank (0 when vLLM runs one)."""
        if self.layer_map.layout.tp_size == 1:
            return 0
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())

    def _stats_path(self) -> Path | None:
        """Where this worker writes its counters: `stats_path`, or at tensor_parallel_size > 1
        `stats_path` with `.rank<r>` before its suffix (ranks never overwrite each other)."""
        path = self.settings.stats_path
        if path is None or self.layer_map.layout.tp_size == 1:
            return path
        return path.with_name(f"{path.stem}.rank{self._worker_rank()}{path.suffix}")

    def _scheduler_stats(self) -> None:
        """The scheduler half's counters to `stats_path` with `.scheduler` before its suffix."""
        path = self.settings.stats_path
        if path is not None:
            self.lookups.write_stats(
                path.with_name(f"{path.stem}.scheduler{path.suffix}"),
                kv_role=self.kv_role.name,
                lookups=self.book.lookups,
                hit_tokens=self.book.hit_tokens,
            )

    # ---- scheduler side ---------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        if cacheable(request):
            self._requests[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not cacheable(request):
            return 0, False
        self._requests[request.request_id] = request
        self._local[request.request_id] = num_computed_tokens
        if request.request_id in self._failed_loads:
            return 0, False  # its load failed once: recompute it (a retry would fail again)
        with self.lookups.asking(request.request_id):
            hit = self.book.matched(
                request.request_id, list(request.all_token_ids), num_computed_tokens
            )
        if hit is None:
            # a store in flight writes the next page (a kv_consumer's wait, `vllm/lookups.py`):
            # vLLM skips the request this step and asks again; its thread is never held
            return None, False
        return hit, self.async_loads and hit > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        local = self._local.get(request.request_id, 0)
        self.book.allocated(
            request.request_id,
            list(request.all_token_ids),
            local,
            num_external_tokens,
            blocks.get_block_ids(),
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled: list[Scheduled] = []
        counts = scheduler_output.num_scheduled_tokens
        entries = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        entries += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, computed in entries:
            request = self._requests.get(req_id)
            if request is None or self._kv_cache_manager is None:
                continue
            scheduled.append(
                Scheduled(
                    req_id,
                    list(request.all_token_ids),
                    int(computed),
                    int(counts.get(req_id, 0)),
                    self._kv_cache_manager.get_blocks(req_id).get_block_ids(),
                    block_hashes=request.block_hashes if self.kv_events else (),
                    prompt_tokens=int(request.num_prompt_tokens),
                )
            )
        self._scheduler_stats()
        return HicacheConnectorMetadata(self.book.step(scheduled))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Asynchronous loads that failed: vLLM asks for those requests' hits again at once;
        they get none, so a load that fails every time cannot hold a request forever."""
        self._failed_loads.update(connector_output.failed_recving or ())
        if connector_output.kv_cache_events is not None:
            self.events.add(connector_output.kv_cache_events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """hicache's stores the workers reported (every rank's), for vLLM's publisher."""
        return self.events.take()

    def _forget(self, req_id: str) -> None:
        self._failed_loads.discard(req_id)
        self._requests.pop(req_id, None)
        self._local.pop(req_id, None)
        self.lookups.forget(req_id)
        self.book.finished(req_id)

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        groups = self._kv_cache_config.kv_cache_groups
        vllm_group, state_specs = {}, {}
        for index, group in enumerate(groups):
            for name in group.layer_names:
                vllm_group[name] = index
                spec = group.kv_cache_spec
                if isinstance(spec, MambaSpec):
                    state_specs[name] = StateSpec(
                        tuple(map(tuple, spec.shapes)), tuple(spec.dtypes)
                    )
        self._layer_ids = {name: extract_layer_index(name) for name in kv_caches}
        # the geometry the client says hello with: the sidecar checks it against its model
        cache_dtypes = CacheDtypes.from_names(
            self._client_args["dtype"],
            self._client_args["state_dtype"],
            self._client_args["ssm_state_dtype"],
        )
        geometries = group_geometries(self.layer_map.groups, cache_dtypes, self.page)
        bindings = bind_layers(
            self.layer_map, geometries, kv_caches, self._layer_ids, vllm_group, state_specs
        )
        # staging (where it is used) serves a full batch of concurrent loads: max_num_seqs
        # prompts of max_model_len, never more pages than vLLM has blocks (loads land in
        # them), plus the scratch page; a memfd's pages cost memory only once written
        batch_pages = self._max_num_seqs * -(-self._max_model_len // self.page)
        token_pages = self.settings.staging_pages or (
            min(batch_pages, int(self._kv_cache_config.num_blocks)) + 1
        )
        staging = {
            g.name: (token_pages if g.kind.is_token_cache else 2 * self._max_num_seqs + 2)
            for g in self.layer_map.groups
        }
        plane = data_plane(self.layer_map, bindings, geometries, self.settings.staging_pages)
        self._shared_kv = plane.memory
        self.worker = WorkerSide(
            self.layer_map,
            bindings,
            lambda: self._connect("engine"),
            staging,
            page_size_tokens=self.page,
            load_timeout_s=self.settings.load_timeout_s,
            retry_after_s=self.settings.retry_after_s,
            state_load_block=state_load_block,
            state_store_block=state_store_block,
            register=plane.register,
            stream=plane.stream,
            persisted_within_s=self.settings.persisted_within_s,
            on_answered=None if self.worker_events is None else self.worker_events.answered,
        )
        self.worker.client()

    def _step(self) -> StepMeta:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HicacheConnectorMetadata)
        return meta.step

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker is None:
            return
        if self.async_loads:
            self.worker.start_async_loads(self._step().loads)
        else:
            self.worker.start_loads(self._step().loads, whole=self.settings.load_mode == "whole")

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before every step's forward: what earlier steps' stores read of vLLM's blocks is
        read before vLLM frees, zeroes or refills any of them."""
        if self.worker is not None:
            self.worker.before_forward()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            layer_id = self._layer_ids.get(layer_name)
            if layer_id is not None:
                self.worker.wait_layer(layer_id)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: `wait_for_save` copies the step's filled blocks whole, after the
        forward wrote every layer (the blocks stay the request's until a later step)."""

    def wait_for_save(self) -> None:
        if self.worker is None:
            return
        self.worker.finish_loads()
        step = self._step()
        self.worker.store(step.stores)
        if self.kv_role.acks_stores and step.stores:
            self.worker.await_stores()  # the step ends with its pages in L2
        stats_path = self._stats_path()
        if stats_path is not None and (step.loads or step.stores):
            self.worker.counters.write(stats_path)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Asynchronous loads that ended: vLLM schedules them next step (the failed ones
        recomputed from scratch; they are also in finished_recving, as vLLM expects)."""
        if self.worker is None:
            return KVConnectorTransferResults()
        done, failed = self.worker.poll_async()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """This step's answered stores as events (`vllm/kv_events.py`); never waits."""
        if self.worker is None or self.worker_events is None:
            return None
        self.worker.harvest_stores()
        taken = self.worker_events.take()
        counters = self.worker.counters
        counters.kv_events_reported += 0 if taken is None else len(taken.get_all_events())
        counters.kv_events_dropped = self.worker_events.dropped
        return taken

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker is None:
            return set()
        return self.worker.take_load_errors()

    def shutdown(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.close()
        lookups = getattr(self, "lookups", None)
        if lookups is not None:
            lookups.close()
