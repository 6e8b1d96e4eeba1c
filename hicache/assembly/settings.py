"""A deployment's sections as the plain settings the builders take: the only reader of
`Deployment` sections below the CLI (with the rest of `hicache.assembly`).

`stack_settings` (model, device, host, scheduler -> `StackSettings`), `cache_settings`
(cache -> `CacheSettings`, the tenant's salt composed by `tenant_salt`), `service_settings`
(service -> `ServiceSettings`) and `model_dtypes`. Every default lives in the schema; these
functions only copy values across, so an embedded cache and the sidecar's cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import SecretStr

from hicache.cache.settings import CacheSettings
from hicache.config.schema import (
    CacheSection,
    Deployment,
    DeviceSection,
    HostSection,
    KvEventsSection,
    ModelSection,
    SchedulerSection,
    ServiceSection,
)
from hicache.embedded import StackSettings
from hicache.memory import CacheDtypes, GroupGeometry, group_geometries
from hicache.model import LayerMap


def model_dtypes(model: ModelSection) -> CacheDtypes:
    """The dtypes of `model.dtype`, `state_dtype` and `ssm_state_dtype`."""
    return CacheDtypes.from_names(model.dtype, model.state_dtype, model.ssm_state_dtype)


def geometries(d: Deployment, layer_map: LayerMap) -> dict[str, GroupGeometry]:
    """Each group's geometry at the deployment's dtypes and page size."""
    return group_geometries(layer_map.groups, model_dtypes(d.model), d.model.page_size_tokens)


def device_pages(device: DeviceSection, geometries: dict[str, GroupGeometry]) -> int:
    """L1 pages per group that `device.pool_capacity_bytes` buys (at least one)."""
    return max(1, device.pool_capacity_bytes // sum(g.page_bytes for g in geometries.values()))


def sections_stack_settings(
    dtypes: CacheDtypes,
    page_size_tokens: int,
    device_pages: int | dict[str, int],
    host: HostSection,
    scheduler: SchedulerSection,
) -> StackSettings:
    """`StackSettings` from the host and scheduler sections (tests give sections built from
    the schema's defaults plus what they change)."""
    return StackSettings(
        dtypes=dtypes,
        page_size_tokens=page_size_tokens,
        device_pages=device_pages,
        host_capacity_bytes=host.capacity_bytes,
        host_layout=host.layout,
        host_state_fraction=host.state_fraction,
        queue_depth=scheduler.queue_depth,
        inflight_bytes=scheduler.inflight_bytes,
        op_timeout_s=scheduler.op_timeout_s,
        move_policy=scheduler.move_policy,
        counter_ring_size=scheduler.counter_ring_size,
    )


def stack_settings(d: Deployment, layer_map: LayerMap) -> StackSettings:
    """What `EmbeddedCache.build` takes, from `model`, `device`, `host` and `scheduler`."""
    return sections_stack_settings(
        model_dtypes(d.model),
        d.model.page_size_tokens,
        device_pages(d.device, geometries(d, layer_map)),
        d.host,
        d.scheduler,
    )


def tenant_salt(section_salt: str, tenant: str) -> str:
    """The salt of a tenant's page keys: `cache.tenant_salt`, a separator (so ("a", "bc")
    and ("ab", "c") never share keys), the tenant ("" for an embedded cache and for an
    engine that names none: they share keys)."""
    return f"{section_salt}\x00{tenant}"


def cache_settings(section: CacheSection, tenant: str) -> CacheSettings:
    """What `TieredCache.build` takes, from the `cache` section, for `tenant`."""
    return CacheSettings(
        write_policy=section.write_policy,
        prefetch_policy=section.prefetch_policy,
        prefetch_timeout_s=section.prefetch_timeout_s,
        prefetch_timeout_per_token_s=section.prefetch_timeout_per_token_s,
        prefetch_auto_headroom=section.prefetch_auto_headroom,
        prefetch_auto_floor_s=section.prefetch_auto_floor_s,
        prefetch_timeout_max_s=section.prefetch_timeout_max_s,
        eviction=section.eviction,
        key_algorithm=section.key_algorithm,
        tenant_salt=tenant_salt(section.tenant_salt, tenant),
        l3_index_max_pages=section.l3_index_max_pages,
        l3_absent_ttl_s=section.l3_absent_ttl_s,
        persist_queue_pages=section.persist_queue_pages,
    )


@dataclass(frozen=True, slots=True)
class ServiceSettings:
    """The sidecar's process settings (the `service` section's, by the same names): its
    listeners, sessions, back-pressure, drain and logs."""

    socket_path: Path
    tcp_host: str
    tcp_port: int | None
    http_host: str
    http_port: int | None
    token: SecretStr | None
    admin_without_token: bool
    heartbeat_timeout_s: float
    max_frame_bytes: int
    max_sessions: int
    load_slots: int
    max_unread_reply_bytes: int
    max_pipelined_requests: int
    slow_reader_timeout_s: float
    drain_timeout_s: float
    log_format: Literal["text", "json"]
    kv_events: KvEventsSection | None


def service_settings(section: ServiceSection) -> ServiceSettings:
    return ServiceSettings(**{name: getattr(section, name) for name in ServiceSection.model_fields})


def engine_channel(d: Deployment) -> tuple[str, str | None]:
    """Where an engine reaches the sidecar serving `d` (`service.socket_path`) and the token
    it presents (`service.token`, None when none is set)."""
    token = d.service.token
    return str(d.service.socket_path), None if token is None else token.get_secret_value()


def client_settings(d: Deployment) -> dict[str, Any]:
    """The `Client` keywords of an engine of the model `d` describes, as the sidecar serving
    it expects them: its dtypes, page size, address and token."""
    address, token = engine_channel(d)
    return {
        "address": address,
        "dtype": d.model.dtype,
        "state_dtype": d.model.state_dtype,
        "ssm_state_dtype": d.model.ssm_state_dtype,
        "page_size_tokens": d.model.page_size_tokens,
        "token": token,
    }
