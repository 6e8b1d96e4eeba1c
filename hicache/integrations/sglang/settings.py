"""The SGLang storage backend's settings: the `--hicache-storage-backend-extra-config` keys
SGLang leaves to it, checked key by key (an unknown key, a bad number or a missing
`interface_v1` is a `ConfigError` naming the key, the value and what is allowed). No SGLang
import, so the checks are tested without it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.config import LoadedConfig, load_deployment
from hicache.errors import ConfigError

WHERE = "--hicache-storage-backend-extra-config"
OWN_KEYS = (
    "config",
    "token",
    "tenant",
    "timeout_s",
    "load_timeout_s",
    "retry_after_s",
    "persisted_within_s",
)
# what SGLang itself reads from the same JSON (the ones it pops before the backend sees them
# too, should a release leave them in)
SGLANG_KEYS = (
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "allocator",
    "prefetch_threshold",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
    "tp_lcm_size",
)


@dataclass(frozen=True, slots=True)
class BackendSettings:
    config_path: Path
    loaded: LoadedConfig
    token: str | None
    tenant: str | None  # None: by SGLang's host layout (`host_pools.tenant_of`)
    timeout_s: float  # one request to the sidecar
    # one load's copies; past it the load is cancelled and waited for as long again
    load_timeout_s: float
    retry_after_s: float  # a sidecar that is down is tried again after this
    # an MLA model at TP > 1: rank 0's store is answered once L3 holds its latents (the other
    # ranks read them there), at most this long; less than timeout_s
    persisted_within_s: float

    @property
    def l3_wait_s(self) -> float:
        """How long the sidecar waits for a load's L3-only pages (SGLang's prefetch IO
        thread calls: it would rather wait than miss): half of one request's timeout_s."""
        return self.timeout_s / 2

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> BackendSettings:
        unknown = sorted(set(extra) - set(OWN_KEYS) - set(SGLANG_KEYS))
        if unknown:
            raise ConfigError(
                f"{WHERE}: unknown keys {unknown}; hicache's: {', '.join(OWN_KEYS)} "
                f"(SGLang's own: {', '.join(SGLANG_KEYS)})"
            )
        if not extra.get("interface_v1"):
            raise ConfigError(
                f'{WHERE}: interface_v1 is {extra.get("interface_v1")!r}; set "interface_v1": 1 '
                "(hicache copies pages between SGLang's host pool and its own; without it SGLang "
                "hands over page tensors by the deprecated batch_get/batch_set)"
            )
        config = extra.get("config")
        if not isinstance(config, str) or not config:
            raise ConfigError(
                f"{WHERE}: config is {config!r}; give the path of the sidecar's deployment file "
                "(the deploy.yaml `hicache serve --config` runs with: its socket, model, page size)"
            )
        token = extra.get("token")
        if token is not None and not isinstance(token, str):
            raise ConfigError(f"{WHERE}: token must be a string (got a {type(token).__name__})")
        tenant = extra.get("tenant")
        if tenant is not None and not isinstance(tenant, str):
            raise ConfigError(f"{WHERE}: tenant is {tenant!r}; give a string")
        timeout_s = _positive(extra, "timeout_s", 5.0)
        persisted_within_s = _positive(extra, "persisted_within_s", min(3.0, timeout_s / 2))
        if persisted_within_s >= timeout_s:
            raise ConfigError(
                f"{WHERE}: persisted_within_s is {persisted_within_s!r} and timeout_s "
                f"{timeout_s!r}; persisted_within_s must be less than timeout_s (a store that "
                "waits for L3 is one request to the sidecar)"
            )
        return cls(
            config_path=Path(config),
            loaded=load_deployment(Path(config)),
            token=token,
            tenant=tenant,
            timeout_s=timeout_s,
            load_timeout_s=_positive(extra, "load_timeout_s", 10.0),
            retry_after_s=_positive(extra, "retry_after_s", 1.0),
            persisted_within_s=persisted_within_s,
        )


def _positive(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{WHERE}: {key} is {value!r}; give a number of seconds > 0")
    return float(value)


def check_ranks(config: Any) -> None:
    """Parallelism hicache's namespaces follow (SGLang's `HiCacheStorageConfig`): tensor
    parallel (and DP replicas) only. An MLA model's ranks all hold the same latent: the
    sidecar keys its MLA group as rank 0 on every rank (`cache.keyers`), so they share."""
    split = {
        "pp_size": config.pp_size,
        "attn_cp_size": config.attn_cp_size,
        "dcp_size": getattr(config, "dcp_size", 1),
    }
    wrong = {k: v for k, v in split.items() if v != 1}
    if wrong:
        raise ConfigError(
            f"SGLang runs with {wrong}; hicache's storage backend serves tensor parallelism "
            "only (pipeline, attention context and decode context parallel sizes must be 1)"
        )
