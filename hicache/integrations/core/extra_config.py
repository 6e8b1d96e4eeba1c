"""An engine's free-form settings for hicache (vLLM's `kv_connector_extra_config`, SGLang's
`linker_extra_config`), checked the same way for every engine: unknown keys refused with the
allowed ones, the sidecar's address from its deployment file (or given), numbers that must be
positive. Each error is a `ConfigError` naming where the settings came from (`where`), the
key, the value and what is allowed. No engine import."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache.assembly import engine_channel
from hicache.config import load_deployment
from hicache.errors import ConfigError


def refuse_unknown(extra: Mapping[str, Any], allowed: Sequence[str], where: str) -> None:
    unknown = sorted(set(extra) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; allowed: {', '.join(allowed)}")


def sidecar_address(extra: Mapping[str, Any], where: str) -> tuple[str, str | None]:
    """The sidecar's engine address and token: `address` (and `token`) as given, or both
    from the deployment file `config` names (a given `token` wins over the file's)."""
    token = extra.get("token")
    address = extra.get("address")
    if address is None:
        config = extra.get("config")
        if config is None:
            raise ConfigError(
                f"{where}: give 'config' (the sidecar's deploy.yaml) or 'address' (its "
                "socket path or tcp://host:port)"
            )
        address, configured = engine_channel(load_deployment(Path(str(config))).deployment)
        token = configured if token is None else token
    return str(address), None if token is None else str(token)


def positive(extra: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = extra.get(key, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if not number > 0:
        raise ConfigError(f"{where}.{key}: {value!r} is not a positive number")
    return number
