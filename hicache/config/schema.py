"""The deployment schema: one pydantic model for everything a hicache process is told.

Nested sections, `extra="forbid"` everywhere, units in field names, sizes as `"64GiB"`
strings or byte counts, and strategies chosen by `Literal` names. `Deployment` is frozen once
loaded; `loader.load_deployment` builds it from YAML plus `HICACHE_*` environment overrides.
The storage, service and tenants sections live in `storage_schema.py`, `service_schema.py`
and `tenants_schema.py`, the `Section` base and `ByteSize` in `section.py`; every one is
re-exported here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from hicache.config.section import ByteSize, Section
from hicache.config.service_schema import KvEventsSection, ServiceSection
from hicache.config.sizes import parse_bytes
from hicache.config.storage_schema import (
    FileStorage,
    L3Guard,
    MooncakeStorage,
    NoStorage,
    RedisStorage,
    StorageSection,
)
from hicache.config.tenants_schema import TenantShare, TenantsSection
from hicache.model.explicit import LayerEntry

__all__ = [
    "ByteSize",
    "CacheSection",
    "Deployment",
    "DeviceSection",
    "Dtype",
    "FileStorage",
    "HostSection",
    "KvEventsSection",
    "L3Guard",
    "ModelSection",
    "MooncakeStorage",
    "NoStorage",
    "RedisStorage",
    "SchedulerSection",
    "Section",
    "ServiceSection",
    "StorageSection",
    "TenantShare",
    "TenantsSection",
]


Dtype = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]


class ModelSection(Section):
    """The model whose KV hicache moves: a Hugging Face config.json, or an explicit list."""

    config_path: Path | None = Field(
        default=None, description="config.json of the checkpoint; relative to the YAML file"
    )
    model_type: str = Field(default="explicit", description="name for an explicit layer list")
    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="the weights' identity, part of every page key: hosts sharing an L3 must "
        "agree on it, different weights (fine-tunes of one architecture) must not; default: "
        "the checkpoint's _name_or_path, else its folder",
    )
    layers: list[LayerEntry] | None = Field(default=None, description="explicit layer list")
    dtype: Dtype = Field(default="bfloat16", description="KV cache dtype (fp8 stored as uint8)")
    state_dtype: Dtype | None = Field(
        default=None,
        description="dtype of linear / mamba / conv state caches (vLLM mamba_cache_dtype); "
        "default: dtype, and required beside an fp8 KV cache",
    )
    ssm_state_dtype: Dtype | None = Field(
        default=None,
        description="dtype of the SSM / recurrent state, every state tensor but conv (vLLM "
        "mamba_ssm_cache_dtype, SGLang mamba_ssm_dtype); default: state_dtype",
    )
    index_format: Literal["kv_dtype", "fp8_scaled"] = Field(
        default="kv_dtype",
        description="how a sparse-attention layer's indexer keys are stored (DeepSeek-V3.2, "
        "GLM-5): kv_dtype as transformers keeps them; fp8_scaled (fp8 keys, a float32 scale per "
        "128 dims) as SGLang and vLLM keep them",
    )
    page_size_tokens: int = Field(
        default=16, ge=1, le=4096, description="tokens per page; match the engine's page size"
    )
    tp_size: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="tensor-parallel size of the engine: each rank caches its share of the KV "
        "heads (and state), as vLLM / SGLang split them; MLA latents are stored once for all",
    )
    start_layer: int = Field(default=0, ge=0, description="first layer of this pipeline stage")
    end_layer: int | None = Field(default=None, ge=1, description="end (exclusive) of the stage")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.config_path is None) == (self.layers is None):
            raise ValueError("give exactly one of config_path (a config.json) or layers")
        return self


class DeviceSection(Section):
    """L1: the engine's pool. The demo allocates one of `pool_capacity_bytes` itself."""

    kind: Literal["cpu", "cuda"] = Field(
        default="cpu", description="where the engine's KV lives and the copies run"
    )
    index: int = Field(default=0, ge=0, description="CUDA device index")
    pool_capacity_bytes: ByteSize = Field(
        default=parse_bytes("64MiB"),
        gt=0,
        description="L1 pool the embedded stack allocates when no engine gives its own",
    )


class HostSection(Section):
    """L2: one preallocated, prefaulted host buffer per cache group, pinned when CUDA is used."""

    capacity_bytes: ByteSize = Field(
        default=parse_bytes("256MiB"),
        gt=0,
        description="L2 per engine namespace: token groups share it by tokens, state groups "
        "(linear / Mamba / conv) get state_fraction of it in snapshots",
    )
    state_fraction: float = Field(
        default=0.25,
        gt=0,
        lt=1,
        description="share of capacity_bytes for state snapshots, when the model has state "
        "groups beside token groups",
    )
    layout: Literal["layer_first", "page_first"] = Field(
        default="layer_first",
        description="layer_first: a layer's pages are contiguous (layer-wise loads); "
        "page_first: a page's layers are contiguous (one L3 object per page)",
    )
    pin_memory: Literal["auto", "always", "never"] = Field(
        default="auto", description="page-lock L2 for DMA; auto: when CUDA is used"
    )
    pin_chunk_bytes: ByteSize = Field(
        default=parse_bytes("64GiB"),
        gt=0,
        le=parse_bytes("64GiB"),
        description="pin (cudaHostRegister) in chunks of at most this size",
    )
    prefault: bool = Field(
        default=True, description="touch every page at start (no first-use faults)"
    )


class SchedulerSection(Section):
    """The transfer scheduler: queue, byte budget, deadlines and the layer-done counter ring."""

    queue_depth: int = Field(default=64, ge=1, le=65536, description="ops waiting, at most")
    inflight_bytes: ByteSize = Field(
        default=parse_bytes("256MiB"), gt=0, description="bytes of walks in flight, at most"
    )
    op_timeout_s: float = Field(
        default=30.0, gt=0, description="an op not done by then expires (pins released)"
    )
    move_policy: Literal["hybrid", "full_attention_only"] = Field(
        default="hybrid",
        description="hybrid: every group moves what it needs; full_attention_only: the plain "
        "is_full_attention_layer filter, for engines that recompute the rest",
    )
    counter_ring_size: int = Field(default=3, ge=1, le=64, description="loads in flight at once")


class CacheSection(Section):
    """How the index keys pages and moves them between tiers."""

    write_policy: Literal["write_through", "write_through_selective", "write_back"] = Field(
        default="write_through",
        description="when L2 pages go to L3: on store, once hit often enough, or on eviction",
    )
    prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = Field(
        default="timeout",
        description="how long a load waits for L3 -> L2: not at all (fetch in the background), "
        "until complete, or a deadline (prefetch_timeout_s); what misses it is fetched on in "
        "the background",
    )
    prefetch_timeout_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | Literal["auto"] = (
        Field(
            default="auto",
            description="the timeout policy's deadline: seconds (plus "
            "prefetch_timeout_per_token_s per token asked for), or auto: the hit's L3-only "
            "bytes, behind those L3 is reading for other loads, at L3's read rate measured "
            "over recent fetches (50 MB/s before the first), times prefetch_auto_headroom, "
            "plus prefetch_auto_floor_s, at most prefetch_timeout_max_s",
        )
    )
    prefetch_timeout_per_token_s: float = Field(
        default=2e-6,
        ge=0,
        allow_inf_nan=False,
        description="a fixed prefetch_timeout_s grows by this per token asked for",
    )
    prefetch_auto_headroom: float = Field(
        default=2.0,
        gt=0,
        allow_inf_nan=False,
        description="auto deadline: times the read time L3's measured rate predicts",
    )
    prefetch_auto_floor_s: float = Field(
        default=0.01,
        ge=0,
        allow_inf_nan=False,
        description="auto deadline: at least this (a small read's latency, the loop's jitter)",
    )
    prefetch_timeout_max_s: float = Field(
        default=1.0,
        gt=0,
        allow_inf_nan=False,
        description="auto deadline: at most this, what a hanging L3 may cost a load (a down "
        "one costs nothing: its breaker answers at once)",
    )
    eviction: Literal["lru", "s3fifo"] = Field(
        default="lru", description="L2 eviction; s3fifo resists one-off scans"
    )
    key_algorithm: Literal["xxh3_128", "blake2b", "sha256"] = Field(
        default="xxh3_128", description="page-key hash (chained over each page's token ids)"
    )
    tenant_salt: str = Field(default="", description="mixed into every page key")
    l3_absent_ttl_s: float = Field(
        default=2.0,
        ge=0,
        description="how long L3's answer that it lacks a page spares asking again (engines "
        "look up a waiting request's prompt at every scheduling step); 0: always ask",
    )
    persist_queue_pages: int = Field(
        default=65_536,
        ge=1,
        description="pages waiting to be written to L3 behind acknowledged stores, at most; "
        "beyond it new ones are dropped (counted), never the store delayed",
    )
    l3_index_max_pages: int = Field(
        default=262_144,
        ge=1,
        description="pages only L3 holds that the index remembers, per group (least recently "
        "used forgotten first; a forgotten page is found again by asking L3 at lookup)",
    )

    @model_validator(mode="after")
    def _floor_below_cap(self) -> CacheSection:
        if self.prefetch_auto_floor_s > self.prefetch_timeout_max_s:
            raise ValueError(
                f"prefetch_auto_floor_s {self.prefetch_auto_floor_s} is above "
                f"prefetch_timeout_max_s {self.prefetch_timeout_max_s}; the floor must be <= "
                "the cap"
            )
        return self


class Deployment(Section):
    model: ModelSection
    device: DeviceSection = DeviceSection()
    host: HostSection = HostSection()
    storage: StorageSection = FileStorage()
    scheduler: SchedulerSection = SchedulerSection()
    cache: CacheSection = CacheSection()
    service: ServiceSection = ServiceSection()
    tenants: TenantsSection = TenantsSection()

    @model_validator(mode="before")
    @classmethod
    def _storage_kind_defaults_to_file(cls, data: Any) -> Any:
        """`storage` without `kind` is the default kind, file: so a file with no storage
        section can still take `HICACHE_STORAGE__PATH` (or a bare `storage: {path: ...}`)."""
        if isinstance(data, dict):
            storage = data.get("storage")
            if isinstance(storage, dict) and "kind" not in storage:
                return {**data, "storage": {"kind": "file", **storage}}
        return data
