"""The vLLM connector's settings: `kv_connector_extra_config`, checked key by key (an unknown
key, a bad number or mode is a `ConfigError` naming the key, the value and what is allowed).
No vLLM import, so the checks are tested without it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.channel.protocol import MAX_STORE_WAIT_S
from hicache.errors import ConfigError
from hicache.integrations.core.extra_config import positive, refuse_unknown, sidecar_address

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
WHERE = "kv_connector_extra_config"


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
        refuse_unknown(extra, EXTRA_KEYS, WHERE)
        address, token = sidecar_address(extra, WHERE)
        staging = None
        if extra.get("staging_pages") is not None:
            staging = int(positive(extra, "staging_pages", 1, WHERE))
        return cls(
            address,
            token,
            extra.get("tenant"),
            positive(extra, "load_timeout_s", 10.0, WHERE),
            staging,
            positive(extra, "retry_after_s", 1.0, WHERE),
            _choice(extra, "load_mode", LOAD_MODES),
            None if extra.get("stats_path") is None else Path(str(extra["stats_path"])),
            _store_wait(extra, "store_wait_s"),
            _store_wait(extra, "persisted_within_s") or 0.0,
        )


def _choice(extra: dict[str, Any], key: str, allowed: tuple[str, ...]) -> str:
    value = extra.get(key, allowed[0])
    if value not in allowed:
        raise ConfigError(f"{WHERE}.{key}: {value!r} is not one of {', '.join(allowed)}")
    return str(value)


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
            f"{WHERE}.{key}: {value!r}; seconds from 0 (never wait) to {MAX_STORE_WAIT_S:g}"
        )
    return number
