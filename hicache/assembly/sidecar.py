"""`SidecarPlan`: what `hicache serve` serves, read once from a deployment — its process
settings (`service`), the layout and geometry engines must match, how page keys are made —
and the one way it builds a namespace's cache (`namespace_cache`) and an L3 store for the
admin API (`attach_store`). The service holds the plan, never the `Deployment`.

Lifecycle: built by `sidecar_plan(loaded)` at start-up (after `host_pages`), frozen, held by
the `EngineServer` for the process's life.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from hicache.assembly.settings import ServiceSettings, geometries, service_settings, tenant_salt
from hicache.assembly.stacks import namespace_cache
from hicache.assembly.stores import AnyStorage, starting, store_of
from hicache.assembly.tenants import TenantL2, tenant_l2
from hicache.cache import TieredCache
from hicache.config import LoadedConfig
from hicache.config.schema import Deployment, RedisStorage, StorageSection
from hicache.config.urls import redacted_url
from hicache.memory import DevicePool, GroupGeometry
from hicache.model import LayerMap
from hicache.scheduler import MovePolicy
from hicache.storage import GuardedStore
from hicache.transfer import CopyBackend


class StorageBodyError(ValueError):
    """An admin attach's body is not a storage section: the problem, as one line."""


@dataclass(frozen=True)
class AttachRequest:
    """A storage section the admin API was asked to attach, and where it came from."""

    _section: AnyStorage = field(repr=False)
    source: str  # "configured" or "body"

    @property
    def kind(self) -> str:
        return self._section.kind

    @property
    def asked(self) -> dict[str, Any]:
        """What the audit log records: the source, the kind, a Redis URL redacted."""
        asked: dict[str, Any] = {"section": self.source, "kind": self._section.kind}
        if isinstance(self._section, RedisStorage):
            asked["url"] = redacted_url(self._section.url)
        return asked

    def open(self) -> GuardedStore | None:
        """The store (`assembly.store_of`); the backend's own errors propagate."""
        return store_of(self._section)


@dataclass(frozen=True)
class SidecarPlan:
    layer_map: LayerMap  # one rank's share at model.tp_size
    model_name: str  # the weights' identity in every page key
    service: ServiceSettings
    geometries: dict[str, GroupGeometry]
    page_size_tokens: int
    tp_size: int  # model.tp_size: the engines' tensor-parallel size
    device_kind: str  # device.kind: which data plane engines register pools on
    move_policy: MovePolicy
    key_algorithm: str
    storage_kind: str  # storage.kind as configured
    _deployment: Deployment = field(repr=False)
    # tenants.shared_l2: each tp_rank's L2 shared by its tenants (filled as namespaces start)
    shared_l2: TenantL2 | None = field(default=None, repr=False)

    def key_salt(self, tenant: str) -> str:
        """The salt of `tenant`'s page keys (`assembly.tenant_salt`)."""
        return tenant_salt(self._deployment.cache.tenant_salt, tenant)

    def namespace_cache(
        self,
        *,
        tp_rank: int,
        tenant: str,
        backend: CopyBackend,
        store: GuardedStore | None,
        device_pools: Mapping[str, DevicePool],
    ) -> TieredCache:
        """A namespace's cache on the engine's pools (`assembly.namespace_cache`)."""
        return namespace_cache(
            self._deployment,
            self.layer_map,
            model_name=self.model_name,
            tenant=tenant,
            tp_rank=tp_rank,
            backend=backend,
            store=store,
            device_pools=device_pools,
            shared_l2=self.shared_l2,
        )

    def attach_request(self, body: object | None) -> AttachRequest:
        """What the admin API's L3 attach asks for: the storage section in `body` (parsed
        JSON), or the configured one (None). A body that is not a storage section raises
        `StorageBodyError` naming each bad key."""
        if body is None:
            return AttachRequest(self._deployment.storage, "configured")
        try:
            section = TypeAdapter(StorageSection).validate_python(body)
        except ValidationError as exc:
            raise StorageBodyError(
                "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            ) from None
        return AttachRequest(section, "body")

    def config_json(self) -> dict[str, Any]:
        """The deployment as `/v1/config` shows it: every value, secrets redacted (the
        storage URL's password, the token)."""
        data: dict[str, Any] = self._deployment.model_dump(mode="json")
        storage = data.get("storage", {})
        if isinstance(storage.get("url"), str):
            storage["url"] = redacted_url(storage["url"])
        if data["service"].get("token") is not None:
            data["service"]["token"] = "***"
        return data


def sidecar_plan(loaded: LoadedConfig) -> SidecarPlan:
    """The plan of `loaded`: its layer map (one rank's share), its model name (an error
    deriving it named by `model.name`) and the settings the service reads."""
    d = loaded.deployment
    layer_map = loaded.layer_map()
    with starting(loaded, "model.name", "cannot derive the model name"):
        model_name = loaded.model_name()
    return SidecarPlan(
        layer_map=layer_map,
        model_name=model_name,
        service=service_settings(d.service),
        geometries=geometries(d, layer_map),
        page_size_tokens=d.model.page_size_tokens,
        tp_size=d.model.tp_size,
        device_kind=d.device.kind,
        move_policy=d.scheduler.move_policy,
        key_algorithm=d.cache.key_algorithm,
        storage_kind=d.storage.kind,
        _deployment=d,
        shared_l2=tenant_l2(d),
    )
