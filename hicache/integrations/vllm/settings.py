"""The vLLM connector's settings: `kv_connector_extra_config`, checked key by key (an unknown
key, a bad number or mode is a `ConfigError` naming the key, the value and what is allowed).
No vLLM import, so the checks are tested without it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.assembly import engine_channel
from hicache.channel.protocol import MAX_STORE_WAIT_S
from hicache.config import load_deployment
from hicache.errors import ConfigError

EXTRA_KEYS = (
    "config",
    "address",
    "token",
    "tenant",
    "load_timeout_s",
    "staging_pages",
    "retry_after_s",
    "load_mode",
    "stats_path",
    "store_wait_s",
    "persisted_within_s",
)
LOAD_MODES = ("auto", "layerwise", "async", "whole")


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    address: str
    token: str | None
    tenant: str | None
    load_timeout_s: float
    staging_pages: int | None
    retry_after_s: float
    load_mode: str
    stats_path: Path | None = None
    # how long a lookup waits for pages a store in flight is writing (None: the kv_role's
    # default, `roles.py`)
    store_wait_s: float | None = None
    # kv_producer: each store answered once L3 holds its pages, at most this long (0: at L2)
    persisted_within_s: float = 0.0

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> ConnectorSettings:
        where = "kv_connector_extra_config"
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown}; allowed: {', '.join(EXTRA_KEYS)}")
        token = extra.get("token")
        address = extra.get("address")
        if address is None:
            config = extra.get("config")
            if config is None:
                raise ConfigError(
                    f"{where}: give 'config' (the sidecar's deploy.yaml) or 'address' (its "
                    "socket path or tcp://host:port)"
                )
            address, configured = engine_channel(load_deployment(Path(config)).deployment)
            token = configured if token is None else token
        staging = None
        if extra.get("staging_pages") is not None:
            staging = int(_positive(extra, "staging_pages", 1))
        return cls(
            str(address),
            None if token is None else str(token),
            extra.get("tenant"),
            _positive(extra, "load_timeout_s", 10.0),
            staging,
            _positive(extra, "retry_after_s", 1.0),
            _choice(extra, "load_mode", LOAD_MODES),
            None if extra.get("stats_path") is None else Path(str(extra["stats_path"])),
            _store_wait(extra, "store_wait_s"),
            _store_wait(extra, "persisted_within_s") or 0.0,
        )


def _choice(extra: dict[str, Any], key: str, allowed: tuple[str, ...]) -> str:
    value = extra.get(key, allowed[0])
    if value not in allowed:
        raise ConfigError(
            f"kv_connector_extra_config.{key}: {value!r} is not one of {', '.join(allowed)}"
        )
    return str(value)


def _positive(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if not number > 0:
        raise ConfigError(f"kv_connector_extra_config.{key}: {value!r} is not a positive number")
    return number


def _store_wait(extra: dict[str, Any], key: str) -> float | None:
    """`key` (`store_wait_s`, `persisted_within_s`): seconds, 0 up to the protocol's
    `MAX_STORE_WAIT_S`; None: not given."""
    value = extra.get(key)
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if isinstance(value, bool) or not 0 <= number <= MAX_STORE_WAIT_S:
        raise ConfigError(
            f"kv_connector_extra_config.{key}: {value!r}; seconds from 0 (never wait) to "
            f"{MAX_STORE_WAIT_S:g}"
        )
    return number
