"""The deployment schema: one pydantic model for everything a hicache process is told.

Nested sections, `extra="forbid"` everywhere, units in field names, sizes as `"64GiB"`
strings or byte counts, and strategies chosen by `Literal` names. `Deployment` is frozen once
loaded; `loader.load_deployment` builds it from YAML plus `HICACHE_*` environment overrides.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SecretStr,
    field_validator,
    model_validator,
)

from hicache.config.sizes import format_bytes, parse_bytes
from hicache.config.urls import cluster_seeds, redacted_url
from hicache.model.explicit import LayerEntry

ByteSize = Annotated[
    int,
    BeforeValidator(parse_bytes),
    PlainSerializer(format_bytes, return_type=str, when_used="json"),
    Field(json_schema_extra={"examples": ["256MiB", 4096]}),
]
Dtype = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


class L3Guard(Section):
    """Every L3 kind but none: call timeouts scaled by bytes, the breaker, the chunk size.

    `GuardedStore` takes these (`hicache.assembly.store_of`): each call times out
    after `base_timeout_s + bytes / min_bandwidth_bytes_per_s`; `breaker_failure_threshold`
    failures in a row open the breaker, `breaker_reset_after_s` later a trial call may close
    it; batches are cut into calls of about `chunk_bytes`."""

    base_timeout_s: float = Field(
        default=1.0,
        gt=0,
        le=600,
        allow_inf_nan=False,
        description="L3 call timeout: this much, plus the call's bytes at "
        "min_bandwidth_bytes_per_s; a timed-out call is a miss and a breaker failure",
    )
    min_bandwidth_bytes_per_s: float = Field(
        default=50e6,
        ge=1e4,
        allow_inf_nan=False,
        description="L3 call timeout: the slowest transfer rate tolerated, bytes per second "
        "(50e6: 50 MB/s)",
    )
    breaker_failure_threshold: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="failed L3 calls in a row that open the breaker (L3 then skipped: misses "
        "at once, loads serve L2 only)",
    )
    breaker_reset_after_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="an open breaker waits this long before a trial call (the sidecar's probe "
        "makes it) that lets L3 back in",
    )
    chunk_bytes: ByteSize = Field(
        default=parse_bytes("16MiB"),
        ge=parse_bytes("64KiB"),
        le=parse_bytes("1GiB"),
        description="L3 batches are cut into calls of about this many bytes, each one timed "
        "(kind mooncake: 64MiB by default, as each of its calls pays a fixed cost)",
    )


_L3_DIRECTORY = "a directory, or a path where one can be created, on a real filesystem"


class FileStorage(L3Guard):
    """L3 on a local directory: one object per page, atomic writes, survives restarts."""

    kind: Literal["file"] = "file"
    path: Path = Field(default=Path(".hicache/l3"), description="directory; relative to the YAML")
    key_prefix: str = Field(
        default="",
        pattern=r"^[A-Za-z0-9._-]*$",
        max_length=128,
        description="objects go in this subfolder of path (letters, digits, . _ -)",
    )

    @field_validator("key_prefix")
    @classmethod
    def _one_folder(cls, value: str) -> str:
        if value.strip(".") == "" and value:
            raise ValueError(f"{value!r} is not a folder name; allowed: letters, digits, . _ -")
        return value

    @field_validator("path")
    @classmethod
    def _can_be_a_directory(cls, value: Path) -> Path:
        """What is known before start-up: the path is not in a kernel pseudo-filesystem, and
        neither it nor a folder above it is an existing non-directory (start-up creates what
        is missing; what only that can tell, such as permissions, it reports then)."""
        where = Path(os.path.abspath(value))
        if where.parts[1:2] in (("proc",), ("sys",)):
            raise ValueError(
                f"{str(value)!r} is in /{where.parts[1]}, a kernel pseudo-filesystem; "
                f"allowed: {_L3_DIRECTORY}"
            )
        for folder in (where, *where.parents):
            try:
                mode = folder.stat().st_mode
            except (FileNotFoundError, NotADirectoryError):
                continue  # missing: start-up creates it; look at the folder above
            except OSError:
                return value  # cannot look (permissions): start-up says why
            if stat.S_ISDIR(mode):
                return value
            what = "a regular file" if stat.S_ISREG(mode) else "not a directory"
            place = (
                f"{str(value)!r} is {what}"
                if folder == where
                else f"{str(value)!r} is under {str(folder)!r}, which is {what}"
            )
            raise ValueError(f"{place}; allowed: {_L3_DIRECTORY}")
        return value

    capacity_bytes: ByteSize = Field(
        default=parse_bytes("1GiB"), gt=0, description="on-disk budget; oldest objects go first"
    )


class RedisStorage(L3Guard):
    """L3 on one Redis server, or on a Redis Cluster (`cluster: true` or a `redis+cluster://`
    URL, whose netloc may list several seed nodes); size is bounded by the servers'
    maxmemory policy."""

    kind: Literal["redis"]
    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="redis://, rediss:// (TLS), unix:// or, for a cluster, "
        "redis+cluster://host:port[,host:port...]",
    )
    cluster: bool = Field(
        default=False,
        description="a Redis Cluster (implied by a +cluster URL): keys go to their slot's node",
    )
    key_prefix: str = Field(default="hicache:", description="prefix of every key")
    max_connections: int = Field(default=16, ge=1, description="connection pool size")
    socket_timeout_s: float = Field(default=2.0, gt=0, description="per socket operation")

    ALLOWED_URLS: ClassVar[str] = (
        "allowed: redis://[user:password@]host[:port][/db], rediss://... (TLS), "
        "unix:///path/to/redis.sock, or for a cluster (db 0 only) "
        "redis+cluster://[user:password@]host[:port][,host[:port]...][/0] or "
        "rediss+cluster://..."
    )

    @staticmethod
    def cluster_seeds(url: str) -> tuple[str, list[tuple[str, int]]]:
        """`hicache.config.urls.cluster_seeds`."""
        return cluster_seeds(url)

    @property
    def is_cluster(self) -> bool:
        return self.cluster or self.url.split("://", 1)[0].endswith("+cluster")

    @field_validator("url")
    @classmethod
    def _a_redis_url(cls, value: str) -> str:
        """The URL's form, as redis-py reads it (whether the server is there is for start-up
        and the breaker to find out)."""
        allowed = cls.ALLOWED_URLS
        parts = urlsplit(value)
        schemes = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
        if parts.scheme not in schemes:
            scheme = f"scheme {parts.scheme!r}" if parts.scheme else "no scheme"
            raise ValueError(f"{redacted_url(value)!r} is not a Redis URL ({scheme}); {allowed}")
        if parts.scheme == "unix":
            if not parts.path:
                raise ValueError(f"{redacted_url(value)!r} names no socket path; {allowed}")
            return value
        try:
            if parts.scheme.endswith("+cluster") or "," in parts.netloc:
                cls.cluster_seeds(value)  # each seed has a host and a valid port
            else:
                _ = parts.port  # parsing it is the check
        except ValueError as exc:
            raise ValueError(f"{redacted_url(value)!r}: {exc}; {allowed}") from None
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"{redacted_url(value)!r}: database {db!r} is not a number; {allowed}")
        return value

    @model_validator(mode="after")
    def _cluster_consistent(self) -> RedisStorage:
        where = redacted_url(self.url)
        scheme = self.url.split("://", 1)[0]
        if scheme.endswith("+cluster") and "cluster" in self.model_fields_set and not self.cluster:
            raise ValueError(
                f"url {where!r} names a cluster ({scheme}://) but cluster is false; drop "
                "cluster: false, or use a redis:// or rediss:// URL for a single server"
            )
        parts = urlsplit(self.url)
        if self.is_cluster:
            if scheme == "unix":
                raise ValueError(
                    f"url {where!r}: a Redis Cluster is reached over TCP, not a unix socket; "
                    f"{self.ALLOWED_URLS}"
                )
            db = parts.path.strip("/")
            if db and int(db) != 0:
                raise ValueError(
                    f"url {where!r}: database {db} with cluster: a Redis Cluster has only "
                    "database 0; use /0 or no path"
                )
        elif "," in parts.netloc:
            raise ValueError(
                f"url {where!r} lists several hosts, which only a cluster takes; set "
                "cluster: true or use a redis+cluster:// URL"
            )
        return self


class MooncakeStorage(L3Guard):
    """L3 on a Mooncake Store cluster (TCP, or RDMA with `rdma_devices`)."""

    kind: Literal["mooncake"]
    master_address: str = Field(default="127.0.0.1:50051", description="mooncake_master host:port")
    local_hostname: str = Field(
        default="127.0.0.1", description="this node's address as other clients reach it"
    )
    metadata_server: str = Field(default="P2PHANDSHAKE", description="or an etcd/http URL")
    key_prefix: str = Field(default="hicache:", max_length=128, description="prefix of every key")
    global_segment_bytes: ByteSize = Field(
        default=parse_bytes("256MiB"), gt=0, description="memory this node adds to the store"
    )
    local_buffer_bytes: ByteSize = Field(
        default=parse_bytes("256MiB"), gt=0, description="registered buffer for transfers"
    )
    protocol: Literal["tcp", "rdma"] = Field(default="tcp", description="transfer protocol")
    chunk_bytes: ByteSize = Field(
        default=parse_bytes("64MiB"),
        ge=parse_bytes("64KiB"),
        le=parse_bytes("1GiB"),
        description="L3 batches are cut into calls of about this many bytes, each one timed "
        "(larger than other kinds': each Mooncake call pays a fixed cost, ~3.6 ms over TCP "
        "between hosts)",
    )
    rdma_devices: str = Field(default="", description="e.g. mlx5_0,mlx5_1 (rdma only)")


class NoStorage(Section):
    """No L3: pages evicted from L2 are dropped."""

    kind: Literal["none"]


StorageSection = Annotated[
    FileStorage | RedisStorage | MooncakeStorage | NoStorage, Field(discriminator="kind")
]


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


class ServiceSection(Section):
    """The sidecar: engine channel (Unix socket, or TCP), HTTP control API, sessions."""

    socket_path: Path = Field(
        default=Path(".hicache/engine.sock"), description="engine channel; created mode 0600"
    )
    tcp_host: str = Field(default="127.0.0.1", description="engine channel over TCP, if tcp_port")
    tcp_port: int | None = Field(
        default=None, ge=0, le=65535, description="engine channel over TCP too (null: off)"
    )
    http_host: str = Field(default="127.0.0.1", description="HTTP control API address")
    http_port: int | None = Field(
        default=9400, ge=0, le=65535, description="null: no HTTP API; 0: any free port"
    )
    token: SecretStr | None = Field(
        default=None,
        description="shared secret: required from engines and for admin endpoints; mandatory "
        "when a listener binds beyond loopback",
    )
    admin_without_token: bool = Field(
        default=False,
        description="with no token, the admin endpoints (clear, L3 detach / attach) are off "
        "(403); true turns them on for every local user (the HTTP API then listens on "
        "loopback only). Ignored when a token is set: it is always required",
    )
    heartbeat_timeout_s: float = Field(
        default=30.0,
        gt=0,
        allow_inf_nan=False,
        description="an engine silent this long is dropped: its loads cancelled, pins released",
    )
    max_frame_bytes: ByteSize = Field(
        default=parse_bytes("16MiB"), ge=1024, description="larger requests are refused"
    )
    max_sessions: int = Field(default=64, ge=1, description="engines attached at once")
    load_slots: int = Field(default=64, ge=1, le=4096, description="unreleased loads per engine")
    max_unread_reply_bytes: ByteSize = Field(
        default=parse_bytes("4MiB"),
        ge=65536,
        description="replies an engine has not read yet, per connection, at most: beyond it the "
        "sidecar stops reading that engine's requests until it reads",
    )
    max_pipelined_requests: int = Field(
        default=256,
        ge=1,
        description="requests of one connection queued behind an awaited op, at most: beyond "
        "it the sidecar stops reading that connection until the queue drains",
    )
    slow_reader_timeout_s: float = Field(
        default=30.0,
        gt=0,
        allow_inf_nan=False,
        description="a connection paused for back-pressure this long is dropped (counted in "
        "hicache_connections_dropped_total)",
    )
    drain_timeout_s: float = Field(
        default=10.0,
        gt=0,
        allow_inf_nan=False,
        description="on SIGTERM, the whole drain fits in this: in-flight loads, then the flush "
        "of what L3 is owed (the rest is counted, not written)",
    )
    log_format: Literal["text", "json"] = Field(
        default="text", description="one line per event: key=value text or JSON"
    )

    @field_validator("token")
    @classmethod
    def _token_not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError(
                "a blank token is no secret; allowed: a non-blank string engines and admins "
                "present, or no token at all (leave service.token out) on loopback-only "
                "listeners"
            )
        if value is not None and value.get_secret_value() != value.get_secret_value().strip():
            # a secret file's trailing newline, kept, would fail every engine's hello
            raise ValueError(
                "the token starts or ends with whitespace (a secret file's trailing newline?); "
                "allowed: a token without leading or trailing whitespace"
            )
        return value

    @model_validator(mode="after")
    def _token_when_exposed(self) -> ServiceSection:
        loopback = {"127.0.0.1", "localhost", "::1"}
        exposed = [
            f"{name}={host}"
            for name, host, port in (
                ("tcp_host", self.tcp_host, self.tcp_port),
                ("http_host", self.http_host, self.http_port),
            )
            if port is not None and host not in loopback
        ]
        if exposed and self.token is None:
            raise ValueError(
                f"{', '.join(exposed)} binds beyond loopback; set service.token (or "
                "HICACHE_SERVICE__TOKEN) so engines and admins must present it"
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
