"""One way in: the only reader of a deployment's sections below the CLI. It turns one
`Deployment` into the objects that run it: the copy backend, the embedded stack, the tiered
cache (an embedded engine's, `embedded_cache`, and each sidecar namespace's,
`namespace_cache`, built by the same code), the L3 store (`open_store`, `store_of`) and the
plain settings the builders and the sidecar take (`StackSettings`, `CacheSettings`,
`ServiceSettings`). The builders below it have no defaults of their own for what a deployment
sets: the schema's are the only ones.
"""

from hicache.assembly.settings import (
    ServiceSettings,
    cache_settings,
    client_settings,
    device_pages,
    engine_channel,
    geometries,
    model_dtypes,
    sections_stack_settings,
    service_settings,
    stack_settings,
    tenant_salt,
)
from hicache.assembly.stacks import (
    copy_backend,
    embedded_cache,
    embedded_stack,
    host_pages,
    namespace_cache,
    tiered_cache,
)
from hicache.assembly.stores import guarded, open_store, starting, storage_backend, store_of

__all__ = [
    "ServiceSettings",
    "cache_settings",
    "client_settings",
    "copy_backend",
    "device_pages",
    "embedded_cache",
    "embedded_stack",
    "engine_channel",
    "geometries",
    "guarded",
    "host_pages",
    "model_dtypes",
    "namespace_cache",
    "open_store",
    "sections_stack_settings",
    "service_settings",
    "stack_settings",
    "starting",
    "storage_backend",
    "store_of",
    "tenant_salt",
    "tiered_cache",
]
