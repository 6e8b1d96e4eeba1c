"""The L3 tier: one small backend interface (with optional zero-copy hooks), the object format
with checksums, the `file`, `redis` and `mooncake` backends (the last two import their client
only when used), the circuit breaker, and `GuardedStore` (timeouts, verification, misses
instead of exceptions). The fault-injecting backend for tests is in `hicache.testing`."""

from hicache.storage.backend import StorageBackend
from hicache.storage.breaker import BreakerState, CircuitBreaker
from hicache.storage.fetch_handles import FetchedInto, FetchInto
from hicache.storage.file_backend import FileBackend
from hicache.storage.guarded import GuardedStore, StoreStats

__all__ = [
    "BreakerState",
    "CircuitBreaker",
    "FetchInto",
    "FetchedInto",
    "FileBackend",
    "GuardedStore",
    "StorageBackend",
    "StoreStats",
]
