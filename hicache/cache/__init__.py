"""The cache an engine talks to: `TieredCache` (the façade: lookup, store, load, prefetch),
built on a pure `Planner` (reservations, pins, victims, pending keys), the op paths that
execute its plans (`Stores`, `Loads`, `Flusher`: the awaits, copies and L3 I/O), a bounded
`PersistQueue` for L3 writes behind acked stores, and `Discovery` (what L3 holds that the
index does not know). See tiered.py."""

from hicache.cache.persist import PersistQueue, PersistStats
from hicache.cache.planner import Planner, PlanStateError
from hicache.cache.stores import StoreResult
from hicache.cache.tiered import CacheNotRunningError, TieredCache

__all__ = [
    "CacheNotRunningError",
    "PersistQueue",
    "PersistStats",
    "PlanStateError",
    "Planner",
    "StoreResult",
    "TieredCache",
]
