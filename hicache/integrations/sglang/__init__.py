"""hicache for SGLang (0.5.23): `HicacheStorage`, a `dynamic` HiCache storage backend
(`module_path: hicache.integrations.sglang`, `class_name: HicacheStorage`; see
`storage_backend.py`). This package is the only one that imports sglang, and only when the
backend is asked for: `settings` and `host_pools` import without it."""

from typing import Any

__all__ = ["HicacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "HicacheStorage":
        from hicache.integrations.sglang.storage_backend import HicacheStorage

        return HicacheStorage
    raise AttributeError(f"module 'hicache.integrations.sglang' has no attribute {name!r}")
