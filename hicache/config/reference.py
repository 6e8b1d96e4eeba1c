"""The configuration reference, generated from the schema (`hicache config reference`): one
Markdown table per section, every key with its type, default and description. docs/reference.md's
reference is this output; a test keeps them equal."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from hicache.config.schema import (
    CacheSection,
    DeviceSection,
    FileStorage,
    HostSection,
    KvEventsSection,
    L3Guard,
    ModelSection,
    MooncakeStorage,
    NoStorage,
    RedisStorage,
    SchedulerSection,
    ServiceSection,
    TenantShare,
    TenantsSection,
)
from hicache.config.sizes import format_bytes

SECTIONS: list[tuple[str, type[BaseModel]]] = [
    ("model", ModelSection),
    ("device", DeviceSection),
    ("host", HostSection),
    ("storage (every kind but none)", L3Guard),
    ("storage (kind: file)", FileStorage),
    ("storage (kind: redis)", RedisStorage),
    ("storage (kind: mooncake)", MooncakeStorage),
    ("storage (kind: none)", NoStorage),
    ("scheduler", SchedulerSection),
    ("cache", CacheSection),
    ("service", ServiceSection),
    ("service.kv_events", KvEventsSection),
    ("tenants", TenantsSection),
    ("tenants.l2_shares.<tenant>", TenantShare),
]


def _type(annotation: Any, field: FieldInfo) -> str:
    if field.metadata and any("parse_bytes" in repr(m) for m in field.metadata):
        return "size"
    origin = get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(annotation))
    if origin in (types.UnionType, typing.Union):
        parts = [_type(a, field) for a in get_args(annotation) if a is not type(None)]
        return " \\| ".join(parts) + (" \\| null" if type(None) in get_args(annotation) else "")
    if origin is typing.Annotated:
        return _type(get_args(annotation)[0], field)
    if origin is list:
        return "list"
    if annotation is SecretStr:
        return "secret"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def _default(name: str, field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default
    if value is PydanticUndefined:
        return "—"
    if value is None:
        return "null"
    if isinstance(value, int) and not isinstance(value, bool) and "bytes" in name:
        return f"`{format_bytes(value)}`"
    if isinstance(value, Path):
        return f"`{value.as_posix()}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _annotation(model: type[BaseModel], name: str) -> Any:
    hints = typing.get_type_hints(model, include_extras=True)
    return hints[name]


def config_reference() -> str:
    lines: list[str] = []
    for title, model in SECTIONS:
        doc = (model.__doc__ or "").strip().splitlines()
        lines.append(f"**`{title}`**" + (f" — {doc[0]}" if doc else ""))
        lines.append("")
        lines.append("| key | type | default | meaning |")
        lines.append("|---|---|---|---|")
        for name, field in model.model_fields.items():
            if model is not L3Guard and issubclass(model, L3Guard) and name in L3Guard.model_fields:
                continue  # in the table of what every L3 kind shares
            kind = _type(_annotation(model, name), field)
            meaning = (field.description or "").replace("|", "\\|")
            lines.append(f"| `{name}` | {kind} | {_default(name, field)} | {meaning} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
