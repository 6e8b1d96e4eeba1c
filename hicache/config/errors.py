"""Turn pydantic's validation errors into one message per problem that names the file, the
dotted key, the bad value, where it came from (file or environment variable) and what is
allowed. A secret's value is never shown, only whether it was blank."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, SecretStr, ValidationError

from hicache.config.urls import redacted_url


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


def format_validation_error(
    exc: ValidationError,
    source: str,
    env_vars: Mapping[str, str] | None = None,
    root: type[BaseModel] | None = None,
) -> str:
    """One line per error: `FILE: key.path: problem (got VALUE[, from environment variable
    VAR])`, the problem saying what is allowed. A key unknown to the schema names the allowed
    keys beside it: `FILE: key.path: unknown key; allowed keys here: ...`, or for one set by
    the environment `VAR (environment variable): unknown key key.path; allowed keys in
    section: ...`."""
    env_vars = env_vars or {}
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        raw = loc
        if root is not None:
            loc, _ = _resolve(root, raw)
        key = _dotted(loc) or "(top level)"
        var = env_vars.get(key)
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            lines.append(_unknown_key(source, key, var, root, raw))
            continue
        got = err.get("input")
        if isinstance(got, dict):
            lines.append(f"{source}: {key}: {message}")
            continue
        if root is not None and _is_secret(root, raw):
            got = _SecretShown(got)
        elif isinstance(got, str) and "://" in got:
            got = redacted_url(got)  # a storage URL's password is a secret too
        origin = f", from environment variable {var}" if var is not None else ""
        lines.append(f"{source}: {key}: {message} (got {got!r}{origin})")
    return "\n".join(lines)


def _unknown_key(
    source: str,
    key: str,
    var: str | None,
    root: type[BaseModel] | None,
    raw: tuple[int | str, ...],
) -> str:
    allowed = (
        sorted({k for m in _resolve(root, raw[:-1])[1] for k in m.model_fields})
        if root is not None
        else []
    )
    if var is None:
        return f"{source}: {key}: unknown key" + (
            f"; allowed keys here: {', '.join(allowed)}" if allowed else ""
        )
    section = key.rpartition(".")[0]
    here = f"in {section}" if section else "at the top level"
    return f"{var} (environment variable): unknown key {key}" + (
        f"; allowed keys {here}: {', '.join(allowed)}" if allowed else ""
    )


class _SecretShown:
    """A secret's input as an error shows it: blank or not, never its characters."""

    def __init__(self, value: object):
        self.blank = isinstance(value, str) and not value.strip()
        self.value = value

    def __repr__(self) -> str:
        if self.blank:
            return f"a blank value, {self.value!r}"
        if isinstance(self.value, str):
            return "'**********'"
        return f"a {type(self.value).__name__}, not shown"


def _is_secret(root: type[BaseModel], raw: tuple[int | str, ...]) -> bool:
    """Whether the error path ends in a `SecretStr` field."""
    if not raw or not isinstance(raw[-1], str):
        return False
    _, parents = _resolve(root, raw[:-1])
    fields = [m.model_fields[raw[-1]] for m in parents if raw[-1] in m.model_fields]
    return any(_holds_secret(f.annotation) for f in fields)


def _holds_secret(annotation: Any) -> bool:
    if annotation is SecretStr:
        return True
    return any(_holds_secret(arg) for arg in typing.get_args(annotation))


def _resolve(
    root: type[BaseModel], loc: tuple[int | str, ...]
) -> tuple[tuple[int | str, ...], list[type[BaseModel]]]:
    """Walk an error path through the schema: the path without the discriminator tags that
    pydantic inserts (`storage.redis.url` -> `storage.url`), and the models the path ends
    in (only the tagged member of a discriminated union)."""
    out: list[int | str] = []
    current: list[type[BaseModel]] = [root]
    keyed = False  # the last field is a mapping: the next part is one of its keys (a name)
    for part in loc:
        if isinstance(part, int):
            out.append(part)
            continue
        fields = [m.model_fields[part] for m in current if part in m.model_fields]
        if fields:
            out.append(part)
            current = [m for f in fields for m in _models_in(f.annotation)]
            keyed = any(typing.get_origin(f.annotation) is dict for f in fields)
            continue
        if keyed:  # e.g. a tenant's name in tenants.l2_shares: its value is the model
            out.append(part)
            keyed = False
            continue
        tagged = [m for m in current if _tag_of(m) == part]
        if tagged and len(current) > 1:
            current = tagged  # the tag picked the union member: not a key the user wrote
            continue
        out.append(part)
        current = []
    return tuple(out), current


def _tag_of(model: type[BaseModel]) -> str | None:
    field = model.model_fields.get("kind")
    args = typing.get_args(field.annotation) if field is not None else ()
    return args[0] if len(args) == 1 and isinstance(args[0], str) else None
