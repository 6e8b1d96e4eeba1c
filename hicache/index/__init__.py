"""The prefix index: page keys, where each page lives per tier, hybrid-aware lookup, eviction
strategies and write/prefetch policies. No torch; it keeps the books, the scheduler moves the
bytes. The L3 backends are in `hicache.storage`; `hicache.cache` wires the two together."""

from hicache.index.absent import AbsentKeys
from hicache.index.eviction import EVICTION_POLICIES, EvictionPolicy, LruPolicy, S3FifoPolicy
from hicache.index.keys import KEY_BYTES, HashAlgorithm, Namespace, PackedKeys, PageKey, PageKeyer
from hicache.index.policies import PREFETCH_POLICIES, WRITE_POLICIES, PrefetchPolicy, WritePolicy
from hicache.index.prefix_index import (
    GroupRule,
    Hit,
    PageIndexError,
    PageRecord,
    PrefixIndex,
    Served,
)

__all__ = [
    "EVICTION_POLICIES",
    "KEY_BYTES",
    "PREFETCH_POLICIES",
    "WRITE_POLICIES",
    "AbsentKeys",
    "EvictionPolicy",
    "GroupRule",
    "HashAlgorithm",
    "Hit",
    "LruPolicy",
    "Namespace",
    "PackedKeys",
    "PageIndexError",
    "PageKey",
    "PageKeyer",
    "PageRecord",
    "PrefetchPolicy",
    "PrefixIndex",
    "S3FifoPolicy",
    "Served",
    "WritePolicy",
]
