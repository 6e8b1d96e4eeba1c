"""The SGLang linker's settings (`linker_extra_config`, checked key by key) and its session with
the sidecar: connected lazily, pools registered once per client, dropped on any failure and
tried again after `retry_after_s`. No sglang import.

Session states:
    down  --client() after retry_after_s (or at first)--> connecting
    connecting --hello + register ok--> up        (the outage's warning re-armed)
    connecting --refused / unreachable--> down     (one warning per outage; no raise)
    up    --failed(op, exc)--> down                (the client closed: its loads end there)
    any   --close()--> closed                      (client() answers None from then on)
Nothing here raises into SGLang's data path: `client()` answers None while down, and every
caller treats None as "no hit / not stored".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.assembly import engine_channel
from hicache.client import Client
from hicache.config import load_deployment
from hicache.errors import ConfigError
from hicache.model import LayerMap, load_layout, shard_layout

log = logging.getLogger("hicache.sglang")

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
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ConfigError(f"{WHERE}: unknown keys {unknown}; allowed: {', '.join(EXTRA_KEYS)}")
        token = extra.get("token")
        address = extra.get("address")
        if address is None:
            config = extra.get("config")
            if config is None:
                raise ConfigError(
                    f"{WHERE}: give 'config' (the sidecar's deploy.yaml) or 'address' (its "
                    "socket path or tcp://host:port)"
                )
            address, configured = engine_channel(load_deployment(Path(str(config))).deployment)
            token = configured if token is None else token
        tenant = extra.get("tenant", "sglang-nhd")
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(f"{WHERE}.tenant: {tenant!r} is not a non-empty string")
        return cls(
            str(address),
            None if token is None else str(token),
            tenant,
            _positive(extra, "load_timeout_s", 10.0),
            _positive(extra, "retry_after_s", 1.0),
        )


def _positive(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if not number > 0:
        raise ConfigError(f"{WHERE}.{key}: {value!r} is not a positive number")
    return number


def layer_map_of(model_path: str, tp_size: int) -> LayerMap:
    """hicache's layout of the model SGLang serves (its config.json), one rank's share."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"SGLang's model path {model_path!r} has no config.json; the linker reads the "
            "model's layout from it"
        )
    return LayerMap(shard_layout(load_layout(path), tp_size))


class LinkerSession:
    """One engine rank's client of the sidecar, or None while it is down."""

    def __init__(
        self,
        settings: LinkerSettings,
        connect: Callable[[], Client],
        register: Callable[[Client], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.settings = settings
        self._connect = connect
        self._register = register
        self._clock = clock
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._next_try = 0.0
        self._warned = False
        self._closed = False
        self.outages = 0

    def client(self) -> Client | None:
        """The client, connecting if due; None while the sidecar is down or refused."""
        with self._lock:
            if self._client is not None or self._closed:
                return self._client
            if self._clock() < self._next_try:
                return None
            client = None
            try:
                client = self._connect()
                self._register(client)
            except Exception as exc:  # unreachable, refused hello, refused pools
                if client is not None:
                    client.close()
                self._down(f"cannot attach to the sidecar at {self.settings.address}: {exc}")
                return None
            self._client = client
            self._warned = False
            log.info("hicache: SGLang linker attached to the sidecar at %s", self.settings.address)
            return client

    def failed(self, op: str, exc: BaseException, client: Client | None = None) -> None:
        """An op failed on the client: drop it (if it is still the current one)."""
        with self._lock:
            if client is not None and client is not self._client:
                return
            dead, self._client = self._client, None
            self._down(f"{op} failed ({type(exc).__name__}: {exc}); no hits until it is back")
        if dead is not None:
            dead.close()

    def _down(self, why: str) -> None:
        self._next_try = self._clock() + self.settings.retry_after_s
        if not self._warned:
            self._warned = True
            self.outages += 1
            log.warning("hicache: %s", why)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
