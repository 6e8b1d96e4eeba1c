"""The deployment's `service` section: the sidecar's engine channel (a Unix socket, or
TCP), its HTTP control API, the token both require beyond loopback, and the limits it keeps
per engine and connection. Re-exported by `schema.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from hicache.config.section import ByteSize, Section
from hicache.config.sizes import parse_bytes


class KvEventsSection(Section):
    """KV events for routers: what the host's shared cache holds, as vLLM publishes them.

    vLLM's KV-event format on a ZMQ PUB socket (`service/kv_events.py`)."""

    endpoint: str = Field(
        default="tcp://127.0.0.1:5557",
        description="ZMQ PUB address the sidecar binds (tcp://host:port or ipc://path); "
        "routers subscribe to it. Events carry prompt token ids: bind beyond loopback only "
        "on a trusted network",
    )
    replay_endpoint: str | None = Field(
        default=None,
        description="ZMQ ROUTER address the sidecar binds for replays, as vLLM's publisher "
        "offers: a subscriber that saw a gap in seq sends the first seq it lacks (8 bytes, "
        "big-endian) and gets the kept batches from there, then seq -1 (null: no replay)",
    )
    buffer_steps: int = Field(
        default=10_000,
        ge=1,
        le=1_000_000,
        description="batches kept for replay (the latest ones; with replay_endpoint)",
    )
    topic: str = Field(default="", description="the topic frame of every message")
    queue_depth: int = Field(
        default=10_000,
        ge=1,
        description="event batches queued for the publisher thread, at most; a batch that "
        "finds the queue full is dropped and counted",
    )
    hwm: int = Field(
        default=100_000, ge=1, description="the PUB socket's send high-water mark (messages)"
    )
    hash_algo: Literal["sha256", "sha256_cbor"] = Field(
        default="sha256", description="the engines' prefix_caching_hash_algo"
    )
    hash_seed: str = Field(
        default="vllm-none-hash",
        description="the seed of vLLM's NONE_HASH: the engines' PYTHONHASHSEED when they set "
        "it, else vLLM's fixed default",
    )
    int_hashes: bool = Field(
        default=True,
        description="publish the hashes' low 64 bits as integers, as vLLM 0.32 does by "
        "default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1); false: the 32-byte hashes, for "
        "engines run with that variable set to 0",
    )

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _endpoint_form(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.startswith(("tcp://", "ipc://")) or value in ("tcp://", "ipc://"):
            raise ValueError(
                f"{value!r} is no ZMQ endpoint the sidecar can bind; allowed: "
                "tcp://host:port (port 0: any free one) or ipc://path"
            )
        return value

    @model_validator(mode="after")
    def _replay_apart(self) -> KvEventsSection:
        same = self.replay_endpoint == self.endpoint
        if same and not self.endpoint.endswith(":0"):  # port 0: two free ports
            raise ValueError(
                f"replay_endpoint {self.replay_endpoint!r} is the endpoint too; allowed: "
                "another address (the replay socket is a ROUTER beside the PUB), or null"
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
    kv_events: KvEventsSection | None = Field(
        default=None,
        description="publish what the shared cache holds as vLLM KV events for cache-aware "
        "routers (null: off)",
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
