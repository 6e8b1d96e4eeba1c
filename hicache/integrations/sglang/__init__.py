"""hicache for SGLang (0.5.23): `HicacheStorage`, a `dynamic` HiCache storage backend
(`module_path: hicache.integrations.sglang`, `class_name: HicacheStorage`; see
`storage_backend.py`), and `linker.HicacheLinker`, SGLang's `UnifiedCacheLinker` with hicache
as the host tier (`linker.py`). Both name pages by SGLang's page hashes through the same keyed
ops (`KeySpec.of_ids`, `store_keys` / `load_keys`). This package is the only one that imports
sglang, and only when the backend or the linker is asked for: `settings`, `host_pools`,
`linker_keys`, `linker_pool` and `linker_settings` import without it."""

from typing import Any

__all__ = ["HicacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "HicacheStorage":
        from hicache.integrations.sglang.storage_backend import HicacheStorage

        return HicacheStorage
    raise AttributeError(f"module 'hicache.integrations.sglang' has no attribute {name!r}")
