"""Load a deployment: YAML file, then `HICACHE_*` environment overrides, then validation.

`HICACHE_SCHEDULER__QUEUE_DEPTH=8` sets `scheduler.queue_depth` (double underscore between
levels). Each value is read by the type of the schema field it sets, never as YAML:

- text (strings, secrets, paths, named choices): the value verbatim, so a token `null`, `123`
  or `yes` is that string;
- integers, numbers: strictly (`8`, `1_000`; `2.5`, `1e-3`), anything else refused;
- booleans: `true` / `false` / `1` / `0` (any case), anything else refused;
- sizes: as in the file (`64GiB`, `4096`);
- a field that may be null (a port, a dtype), and is not text: an empty value or `null`
  unsets it (a text field keeps an empty value, which its checks then judge: a blank token
  is refused);
- lists (`model.layers`): JSON.

A variable naming no key of the schema is refused naming the keys allowed there; one naming a
section rather than a key is refused too. Relative paths in the file are resolved against the
file's directory. The result remembers where each value came from (default, file or
environment) for `hicache config show`.
"""

from __future__ import annotations

import json
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, SecretStr, ValidationError

from hicache.config.errors import format_validation_error
from hicache.config.schema import Deployment
from hicache.errors import ConfigError
from hicache.model import (
    LayerMap,
    ModelLayout,
    load_layout,
    model_identity,
    shard_layout,
    with_index_format,
)
from hicache.model.explicit import ExplicitLayout

ENV_PREFIX = "HICACHE_"
Source = Literal["default", "file", "environment"]


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    deployment: Deployment
    path: Path
    sources: Mapping[str, Source]  # dotted key -> where its value came from
    env_vars: Mapping[str, str]  # dotted key -> the variable that set it

    def source_of(self, key: str) -> str:
        """Where a dotted key's value came from, as an error names it: the variable that set
        it (`HICACHE_HOST__CAPACITY_BYTES (environment variable)`), else the file."""
        var = self.env_vars.get(key)
        return f"{var} (environment variable)" if var is not None else str(self.path)

    def global_layout(self) -> ModelLayout:
        """The whole model's layout (config.json's head counts, indexer keys stored as
        `model.index_format` says), before tensor parallelism."""
        model = self.deployment.model
        try:
            if model.config_path is not None:
                layout = load_layout(model.config_path)
            else:
                explicit = ExplicitLayout(model_type=model.model_type, layers=model.layers or [])
                layout = explicit.to_layout(f"{self.path}: model.layers")
        except ValueError as exc:
            raise ConfigError(f"{self.path}: model: {exc}") from exc
        return with_index_format(layout, model.index_format, self.source_of("model.index_format"))

    def layout(self) -> ModelLayout:
        """What one tensor-parallel rank caches: the global layout split by `model.tp_size`
        (`hicache.model.shard_layout`); the global layout itself at tp_size 1."""
        layout = self.global_layout()
        try:
            return shard_layout(layout, self.deployment.model.tp_size)
        except ValueError as exc:
            source = self.source_of("model.tp_size")
            raise ConfigError(f"{self.path}: model.tp_size (from {source}): {exc}") from exc

    def model_name(self) -> str:
        """The weights' identity joined into every page key: `model.name`, or a default
        derived from the checkpoint (`hicache.model.model_identity`)."""
        model = self.deployment.model
        if model.name is not None:
            return model.name
        return model_identity(model.config_path, self.layout())

    def layer_map(self) -> LayerMap:
        model = self.deployment.model
        try:
            return LayerMap(self.layout(), model.start_layer, model.end_layer)
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(f"{self.path}: model.start_layer/end_layer: {exc}") from exc

    def effective(self) -> list[tuple[str, Any, Source]]:
        """(dotted key, value, source) for every leaf of the effective config."""
        data = self.deployment.model_dump(mode="json")
        return [(key, value, self.sources.get(key, "default")) for key, value in _leaves(data)]


def _leaves(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(data, dict) and data:
        out = []
        for key, value in data.items():
            out.extend(_leaves(value, f"{prefix}.{key}" if prefix else key))
        return out
    return [(prefix, data)]


def _env_overrides(env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """dotted key -> (variable name, raw value)."""
    out = {}
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "CONFIG":
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        if not all(parts):
            raise ConfigError(
                f"environment variable {name}: empty key part; write levels as "
                "HICACHE_SECTION__KEY, e.g. HICACHE_SCHEDULER__QUEUE_DEPTH=8"
            )
        out[".".join(parts)] = (name, raw)
    return out


_INT = re.compile(r"[+-]?[0-9](?:_?[0-9])*")
_TRUE, _FALSE = ("true", "1"), ("false", "0")
_NULL = ("", "null")


def _field_annotation(dotted: str, data: Mapping[str, Any], env_kind: str | None) -> Any:
    """The schema annotation of a dotted key (the storage member its `kind` picks: from the
    environment, else the file, else file), or None when the schema has no such key."""
    models: list[type[BaseModel]] = [Deployment]
    annotation: Any = None
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            return None
        hints = typing.get_type_hints(
            next(m for m in models if part in m.model_fields), include_extras=True
        )
        annotation = hints[part]
        models = _models_of(annotation)
        if len(models) > 1 and i == 0 and part == "storage":
            node = data.get("storage")
            kind = env_kind or (node.get("kind") if isinstance(node, dict) else None) or "file"
            tagged = [m for m in models if _kind_of(m) == kind]
            models = tagged or models
        if i < len(parts) - 1 and not models:
            return None
    return annotation


def _models_of(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        args = args[:1]
    elif typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return []
    return [m for a in args for m in _models_of(a)]


def _kind_of(model: type[BaseModel]) -> str | None:
    field = model.model_fields.get("kind")
    args = typing.get_args(field.annotation) if field is not None else ()
    return args[0] if len(args) == 1 and isinstance(args[0], str) else None


class _Refused(ValueError):
    pass


def _parse(raw: str, annotation: Any) -> Any:
    """`raw` as a value of `annotation`; `_Refused` saying what is allowed."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner, *meta = typing.get_args(annotation)
        if any("parse_bytes" in repr(m) for m in meta):
            return raw  # a size: parsed by the schema, as from the file
        return _parse(raw, inner)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable = len(members) < len(typing.get_args(annotation))
        if nullable and not any(_is_text(m) for m in members) and raw.strip().lower() in _NULL:
            return None
        allowed = []
        for member in sorted(members, key=_choices_first):
            try:
                return _parse(raw, member)
            except _Refused as exc:
                allowed.append(str(exc))
        if nullable and not any(_is_text(m) for m in members):
            allowed.append("empty or null to unset it")
        raise _Refused(", or ".join(allowed))
    if origin is Literal:
        choices = typing.get_args(annotation)
        if raw in choices:
            return raw
        raise _Refused("one of " + ", ".join(map(str, choices)))
    if annotation is bool:
        word = raw.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise _Refused("a boolean: true, false, 1 or 0")
    if annotation is int:
        if _INT.fullmatch(raw.strip()):
            return int(raw.strip())
        raise _Refused("an integer such as 8")
    if annotation is float:
        try:
            return float(raw)
        except ValueError:
            raise _Refused("a number such as 2.5 or 1e-3") from None
    if origin in (list, dict) or annotation in (list, dict) or _models_of(annotation):
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _Refused(f"JSON ({exc.msg} at character {exc.pos})") from None
    return raw  # str, SecretStr, Path and anything else: verbatim, the schema checks it


def _choices_first(annotation: Any) -> bool:
    """Sort key of union members: named choices first (`auto` before a number)."""
    return typing.get_origin(annotation) is not Literal


def _is_text(annotation: Any) -> bool:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation in (str, SecretStr, Path)


def _env_value(dotted: str, var: str, raw: str, annotation: Any) -> Any:
    if annotation is None:
        return raw  # no such key: validation names it and the keys allowed beside it
    sections = _models_of(annotation)
    if sections:
        keys = sorted({k for m in sections for k in m.model_fields})
        raise ConfigError(
            f"environment variable {var}: {dotted} is a section, not a key; set its keys "
            f"one variable each ({var}__KEY), allowed keys in {dotted}: {', '.join(keys)}"
        )
    if typing.get_origin(annotation) is Literal:
        return raw  # a choice by name: validation says which names are allowed
    try:
        return _parse(raw, annotation)
    except _Refused as exc:
        shown = "'**********'" if _holds(annotation, SecretStr) else repr(raw)
        raise ConfigError(
            f"environment variable {var}: {shown} is not allowed for {dotted}; allowed: {exc}"
        ) from None


def _holds(annotation: Any, kind: type) -> bool:
    return annotation is kind or any(_holds(a, kind) for a in typing.get_args(annotation))


def _set(data: dict[str, Any], dotted: str, value: Any, var: str) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"environment variable {var}: {part!r} is a value, not a section, so "
                f"{dotted!r} cannot be set"
            )
        node = child
    node[parts[-1]] = value


def _resolve_paths(
    data: dict[str, Any], base: Path, where: Path, env_vars: Mapping[str, str]
) -> None:
    for section, key in (
        ("model", "config_path"),
        ("storage", "path"),
        ("service", "socket_path"),
    ):
        node = data.get(section)
        if isinstance(node, dict) and isinstance(node.get(key), str):
            if not node[key].strip():  # "" would resolve to the config file's own directory
                dotted = f"{section}.{key}"
                source = f"environment variable {env_vars[dotted]}" if dotted in env_vars else where
                raise ConfigError(
                    f"{source}: {dotted} is empty; allowed: a path (relative paths are "
                    "relative to the config file's directory)"
                )
            path = Path(node[key]).expanduser()
            node[key] = os.path.normpath(path if path.is_absolute() else base / path)


def load_deployment(path: Path | str, env: Mapping[str, str] | None = None) -> LoadedConfig:
    env = os.environ if env is None else env
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); "
            "allowed: a UTF-8 YAML deployment file"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level is {type(data).__name__}; a mapping of sections")
    sources: dict[str, Source] = {key: "file" for key, _ in _leaves(data)}
    env_vars = {}
    overrides = _env_overrides(env)
    env_kind = overrides["storage.kind"][1] if "storage.kind" in overrides else None
    for dotted, (var, given) in overrides.items():
        value = _env_value(dotted, var, given, _field_annotation(dotted, data, env_kind))
        _set(data, dotted, value, var)
        sources[dotted] = "environment"
        env_vars[dotted] = var
    _resolve_paths(data, path.parent.resolve(), path, env_vars)
    try:
        deployment = Deployment.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, str(path), env_vars, Deployment)) from None
    # a leaf under a section given in the file counts as the file's even if written as {}
    return LoadedConfig(deployment, path, sources, env_vars)
