"""The L3 backend for a deployment's `storage` section (a registry keyed by `kind`), and the
`GuardedStore` over it with the section's timeouts, breaker thresholds and chunk size."""

from __future__ import annotations

from hicache.config.schema import FileStorage, L3Guard, MooncakeStorage, NoStorage, RedisStorage
from hicache.storage.backend import StorageBackend
from hicache.storage.file_backend import FileBackend
from hicache.storage.guarded import GuardedStore


def make_backend(
    section: FileStorage | RedisStorage | MooncakeStorage | NoStorage,
) -> StorageBackend | None:
    if isinstance(section, FileStorage):
        root = section.path / section.key_prefix if section.key_prefix else section.path
        return FileBackend(root, section.capacity_bytes)
    if isinstance(section, RedisStorage) and section.is_cluster:
        from hicache.storage.redis_cluster_backend import RedisClusterBackend  # optional extra

        return RedisClusterBackend(
            section.url,
            key_prefix=section.key_prefix,
            max_connections=section.max_connections,
            socket_timeout_s=section.socket_timeout_s,
        )
    if isinstance(section, RedisStorage):
        from hicache.storage.redis_backend import RedisBackend  # redis is an optional extra

        return RedisBackend(
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
    return GuardedStore(backend, **section.guard_settings())


def make_store(
    section: FileStorage | RedisStorage | MooncakeStorage | NoStorage,
) -> GuardedStore | None:
    """The L3 store a `storage` section describes (None for kind none): what the sidecar
    opens, and what an embedded user passes to `TieredCache.build(store=...)`."""
    backend = make_backend(section)
    if backend is None or not isinstance(section, L3Guard):
        return None
    return guarded(backend, section)
