"""The L3 backend for a deployment's `storage` section (a registry keyed by `kind`)."""

from __future__ import annotations

from hicache.config.schema import FileStorage, NoStorage, RedisStorage
from hicache.storage.backend import StorageBackend
from hicache.storage.file_backend import FileBackend


def make_backend(section: FileStorage | RedisStorage | NoStorage) -> StorageBackend | None:
    if isinstance(section, FileStorage):
        return FileBackend(section.path, section.capacity_bytes)
    if isinstance(section, RedisStorage):
        from hicache.storage.redis_backend import RedisBackend  # redis is an optional extra

        return RedisBackend(
            section.url,
            key_prefix=section.key_prefix,
            max_connections=section.max_connections,
            socket_timeout_s=section.socket_timeout_s,
        )
    return None
