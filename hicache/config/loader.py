"""Load a deployment: YAML file, then `HICACHE_*` environment overrides, then validation.

`HICACHE_SCHEDULER__QUEUE_DEPTH=8` sets `scheduler.queue_depth` (double underscore between
levels; the value is read as a YAML scalar). Relative paths in the file are resolved against
the file's directory. The result remembers where each value came from (default, file or
environment) for `hicache config show`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from hicache.config.errors import format_validation_error
from hicache.config.schema import Deployment
from hicache.errors import ConfigError
from hicache.model import LayerMap, ModelLayout, load_layout, model_identity
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

    def layout(self) -> ModelLayout:
        model = self.deployment.model
        try:
            if model.config_path is not None:
                return load_layout(model.config_path)
            explicit = ExplicitLayout(model_type=model.model_type, layers=model.layers or [])
            return explicit.to_layout(f"{self.path}: model.layers")
        except ValueError as exc:
            raise ConfigError(f"{self.path}: model: {exc}") from exc

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


def _env_overrides(env: Mapping[str, str]) -> dict[str, tuple[str, Any]]:
    """dotted key -> (variable name, parsed value)."""
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
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        out[".".join(parts)] = (name, value)
    return out


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


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    for section, key in (
        ("model", "config_path"),
        ("storage", "path"),
        ("service", "socket_path"),
    ):
        node = data.get(section)
        if isinstance(node, dict) and isinstance(node.get(key), str):
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
    for dotted, (var, value) in _env_overrides(env).items():
        _set(data, dotted, value, var)
        sources[dotted] = "environment"
        env_vars[dotted] = var
    _resolve_paths(data, path.parent.resolve())
    try:
        deployment = Deployment.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, str(path), env_vars, Deployment)) from None
    # a leaf under a section given in the file counts as the file's even if written as {}
    return LoadedConfig(deployment, path, sources, env_vars)
