"""The deployment's `storage` section (L3), one model per kind, chosen by `kind`
(`StorageSection`): `file`, `redis` (one server or a Redis Cluster), `mooncake`, and `none`.
Every kind but none shares `L3Guard`'s call timeouts, breaker and chunk size (what
`GuardedStore` takes). Each URL and path is checked for its form here; whether the server is
there, or the directory writable, start-up and the breaker find out. Re-exported by
`schema.py`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Annotated, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from hicache.config.section import ByteSize, Section
from hicache.config.sizes import parse_bytes
from hicache.config.urls import cluster_seeds, redacted_url


class L3Guard(Section):
    """Every L3 kind but none: call timeouts scaled by bytes, the breaker, the chunk size.

    `GuardedStore` takes these (`hicache.assembly.store_of`): each call times out
    after `base_timeout_s + bytes / min_bandwidth_bytes_per_s`; `breaker_failure_threshold`
    failures in a row open the breaker, `breaker_reset_after_s` later an engine's call may
    close it (the sidecar's probe, every second, sooner); batches are cut into calls of
    about `chunk_bytes`."""

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
        description="an open breaker waits this long before an engine call may try L3 again; "
        "the sidecar's probe tries every second meanwhile (at most half of this) and lets L3 "
        "back in as soon as it answers",
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
        default=parse_bytes("256MiB"),
        ge=0,
        description="memory this node adds to the store; 0 adds none, so every object lives in "
        "other clients' segments (a `mooncake_client` holding memory) and outlives this sidecar",
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
