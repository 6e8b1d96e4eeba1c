"""Deployment configuration: the schema, YAML + environment loading, and messages.
Entry point: `load_deployment(path)` -> `LoadedConfig`."""

from hicache.config.loader import LoadedConfig, load_deployment
from hicache.config.schema import Deployment
from hicache.config.sizes import format_bytes, parse_bytes

__all__ = ["Deployment", "LoadedConfig", "format_bytes", "load_deployment", "parse_bytes"]
