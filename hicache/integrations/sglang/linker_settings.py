"""The SGLang linker's settings (`linker_extra_config`, checked key by key) and the model's
layout from SGLang's config.json. No sglang import. The linker's session with the sidecar is
the integration core's `SidecarLink` (`core.sidecar_link`), as the storage backend's is."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.errors import ConfigError
from hicache.integrations.core.extra_config import positive, refuse_unknown, sidecar_address
from hicache.model import LayerMap, load_layout, shard_layout

WHERE = "unified_cache_external_linker_config.linker_extra_config"
EXTRA_KEYS = ("config", "address", "token", "tenant", "load_timeout_s", "retry_after_s")


@dataclass(frozen=True, slots=True)
class LinkerSettings:
    address: str
    token: str | None
    tenant: str
    load_timeout_s: float
    retry_after_s: float

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> LinkerSettings:
        extra = dict(extra or {})
        refuse_unknown(extra, EXTRA_KEYS, WHERE)
        address, token = sidecar_address(extra, WHERE)
        tenant = extra.get("tenant", "sglang-nhd")
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(f"{WHERE}.tenant: {tenant!r} is not a non-empty string")
        return cls(
            address,
            token,
            tenant,
            positive(extra, "load_timeout_s", 10.0, WHERE),
            positive(extra, "retry_after_s", 1.0, WHERE),
        )


def layer_map_of(model_path: str, tp_size: int) -> LayerMap:
    """hicache's layout of the model SGLang serves (its config.json), one rank's share."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"SGLang's model path {model_path!r} has no config.json; the linker reads the "
            "model's layout from it"
        )
    return LayerMap(shard_layout(load_layout(path), tp_size))
