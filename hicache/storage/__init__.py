"""The L3 tier (part of issue 5): one small backend interface, the object format with
checksums, the `file` backend, a fault-injecting backend for tests, and `GuardedStore`
(breaker, timeouts, verification, misses instead of exceptions). Redis and Mooncake Store
backends are not here yet."""

from hicache.storage.backend import StorageBackend
from hicache.storage.faulty import FaultyBackend
from hicache.storage.file_backend import FileBackend
from hicache.storage.guarded import BreakerState, CircuitBreaker, GuardedStore, StoreStats

__all__ = [
    "BreakerState",
    "CircuitBreaker",
    "FaultyBackend",
    "FileBackend",
    "GuardedStore",
    "StorageBackend",
    "StoreStats",
]
