"""`CacheSettings`: what a `TieredCache` is built with, as plain values with no defaults of
their own. `hicache.assembly.cache_settings` reads them from a deployment's `cache` section
(whose defaults are the only ones), so an embedded cache and the sidecar's are built alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """The `cache` section's knobs by name; `tenant_salt` is the effective salt mixed into
    every page key (the section's salt with the namespace's tenant, `assembly.tenant_salt`)."""

    write_policy: str
    prefetch_policy: str
    prefetch_timeout_s: float | Literal["auto"]
    prefetch_timeout_per_token_s: float
    prefetch_auto_headroom: float
    prefetch_auto_floor_s: float
    prefetch_timeout_max_s: float
    eviction: str
    key_algorithm: str
    tenant_salt: str
    l3_index_max_pages: int
    l3_absent_ttl_s: float
    persist_queue_pages: int
