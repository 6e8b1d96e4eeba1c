"""vLLM's KV connector (`HicacheConnector`, in `connector.py`: the one module of the package
that imports vLLM at its top), and the parts it stands on, one role each: the connector's
settings (`settings.py`), the layout derived from vLLM's config (`layout.py`), the scheduler
side's lookups and step book (`lookups.py`, `plan.py`), the worker side (`worker.py`) with its
loads, stores, staging and vLLM's blocks bound and shared (`loads.py`, `stores.py`,
`staging.py`, `binding.py`, `shared_kv.py`).

vLLM loads the connector by `kv_connector_module_path="hicache.integrations.vllm"` and
`kv_connector="HicacheConnector"`: this package gives that name lazily, so that importing any of its
other modules (tests, the layout) never imports vLLM."""

from __future__ import annotations

from typing import Any

__all__ = ["HicacheConnector"]


def __getattr__(name: str) -> Any:
    if name == "HicacheConnector":
        from hicache.integrations.vllm.connector import HicacheConnector

        return HicacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
