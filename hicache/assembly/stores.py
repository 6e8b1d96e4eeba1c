"""The L3 store a deployment's `storage` section describes: its backend (a registry keyed by
`kind`) behind a `GuardedStore` with the section's timeouts, breaker thresholds and chunk
size. The one factory: the sidecar at start-up (`open_store`, its errors named by the key at
fault), its admin API's attach (`store_of`) and an embedded cache (`assembly.embedded_cache`)
all open L3 here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from hicache.config.loader import LoadedConfig
from hicache.config.schema import (
    FileStorage,
    L3Guard,
    MooncakeStorage,
    NoStorage,
    RedisStorage,
)
from hicache.config.urls import redacted_url
from hicache.errors import HicacheError, ServiceStartError
from hicache.storage.backend import StorageBackend
from hicache.storage.file_backend import FileBackend
from hicache.storage.guarded import GuardedStore

if TYPE_CHECKING:
    from hicache.storage.redis_backend import RedisBackend
    from hicache.storage.redis_cluster_backend import RedisClusterBackend

AnyStorage = FileStorage | RedisStorage | MooncakeStorage | NoStorage


def storage_backend(section: AnyStorage) -> StorageBackend | None:
    """The backend of `section` (None for kind none); optional extras imported on demand."""
    if isinstance(section, FileStorage):
        root = section.path / section.key_prefix if section.key_prefix else section.path
        return FileBackend(root, section.capacity_bytes)
    if isinstance(section, RedisStorage):
        # redis is an optional extra: the backend for this URL's shape, imported on demand
        redis_backend: type[RedisBackend] | type[RedisClusterBackend]
        if section.is_cluster:
            from hicache.storage.redis_cluster_backend import RedisClusterBackend as redis_backend
        else:
            from hicache.storage.redis_backend import RedisBackend as redis_backend
        return redis_backend(
            section.url,
            key_prefix=section.key_prefix,
            max_connections=section.max_connections,
            socket_timeout_s=section.socket_timeout_s,
        )
    if isinstance(section, MooncakeStorage):
        from hicache.storage.mooncake_backend import MooncakeBackend  # an optional extra

        return MooncakeBackend(
            section.master_address,
            local_hostname=section.local_hostname,
            metadata_server=section.metadata_server,
            key_prefix=section.key_prefix,
            global_segment_bytes=section.global_segment_bytes,
            local_buffer_bytes=section.local_buffer_bytes,
            protocol=section.protocol,
            rdma_devices=section.rdma_devices,
        )
    return None


def guarded(backend: StorageBackend, section: L3Guard) -> GuardedStore:
    """`backend` behind a `GuardedStore` configured by `section` (`storage.base_timeout_s`,
    `min_bandwidth_bytes_per_s`, `chunk_bytes`, `breaker_failure_threshold`,
    `breaker_reset_after_s`)."""
    return GuardedStore(
        backend,
        base_timeout_s=section.base_timeout_s,
        min_bandwidth_bytes_per_s=section.min_bandwidth_bytes_per_s,
        chunk_bytes=section.chunk_bytes,
        failure_threshold=section.breaker_failure_threshold,
        reset_after_s=section.breaker_reset_after_s,
    )


def store_of(section: AnyStorage) -> GuardedStore | None:
    """The L3 store `section` describes (None for kind none)."""
    backend = storage_backend(section)
    if backend is None or not isinstance(section, L3Guard):
        return None
    return guarded(backend, section)


def cause(exc: BaseException) -> str:
    """An exception as one line (an OSError by its strerror)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return " ".join(f"{type(exc).__name__}: {exc}".split())  # one line


@contextlib.contextmanager
def starting(loaded: LoadedConfig, key: str, what: str) -> Iterator[None]:
    """One start-up step, configured by `key`: an error of a library it calls becomes a
    `ServiceStartError` naming where the key was set, the key, the step and the cause."""
    try:
        yield
    except HicacheError:
        raise
    except Exception as exc:
        raise ServiceStartError(f"{loaded.source_of(key)}: {key}: {what}: {cause(exc)}") from exc


def open_store(loaded: LoadedConfig) -> GuardedStore | None:
    """The L3 store of `storage`, or None; its backend's errors (an L3 directory that cannot
    be created, an unusable URL, a missing optional extra) named by the key at fault."""
    section = loaded.deployment.storage
    if section.kind == "file":
        key, what = "storage.path", f"cannot use {str(section.path)!r} as the L3 directory"
    elif section.kind == "redis":
        key, what = "storage.url", f"cannot use Redis at {redacted_url(section.url)!r}"
    elif section.kind == "mooncake":
        key, what = "storage.master_address", "cannot set up the Mooncake store client"
    else:
        return None
    try:
        with starting(loaded, key, what):
            return store_of(section)
    except ServiceStartError as exc:
        if isinstance(exc.__cause__, ImportError):  # an optional extra not installed
            raise ServiceStartError(
                f"{loaded.source_of('storage.kind')}: storage.kind: {section.kind} needs "
                f"the {section.kind!r} extra (pip install 'hicache[{section.kind}]'): "
                f"{cause(exc.__cause__)}"
            ) from exc.__cause__
        raise
