"""Turn pydantic's validation errors into one message per problem that names the file, the
dotted key, the bad value, where it came from (file or environment variable) and what is
allowed."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, Union, list, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is None:
        return []
    out: list[type[BaseModel]] = []
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        args = args[:1]
    if origin in (typing.Union, types.UnionType, list, tuple, dict, typing.Annotated):
        for arg in args:
            out.extend(_models_in(arg))
    return out


def allowed_keys(root: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The keys allowed at `loc` (the parent of an unknown key), walking the schema."""
    current = [root]
    for part in loc:
        if isinstance(part, int):
            continue
        nxt: list[type[BaseModel]] = []
        for model in current:
            field = model.model_fields.get(part)
            if field is not None:
                nxt.extend(_models_in(field.annotation))
        if not nxt:
            return []
        current = nxt
    keys: set[str] = set()
    for model in current:
        keys.update(model.model_fields)
    return sorted(keys)


def format_validation_error(
    exc: ValidationError,
    source: str,
    env_vars: Mapping[str, str] | None = None,
    root: type[BaseModel] | None = None,
) -> str:
    """One line per error: `FILE: key.path: problem (got VALUE[, from $VAR]); allowed: ...`."""
    env_vars = env_vars or {}
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        # discriminated unions put the tag name ("file") in the path; drop it
        if root is not None:
            loc = tuple(p for p in loc if not (isinstance(p, str) and p in _TAGS))
        key = _dotted(loc) or "(top level)"
        origin = f", from environment variable {env_vars[key]}" if key in env_vars else ""
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            allowed = allowed_keys(root, loc[:-1]) if root is not None else []
            message = "unknown key" + (
                f"; allowed keys here: {', '.join(allowed)}" if allowed else ""
            )
            lines.append(f"{source}: {key}: {message}{origin}")
            continue
        got = err.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r}{origin})"
        lines.append(f"{source}: {key}: {message}{shown}")
    return "\n".join(lines)


_TAGS: set[str] = set()


def register_tags(*tags: str) -> None:
    """Discriminator values that pydantic inserts into error paths (e.g. storage 'file')."""
    _TAGS.update(tags)
