"""Tests' shorthand for a store's arguments: one page list per group (a state group's one
slot holding the snapshot after the prompt's last full page), split into the token groups'
`device_pages` and the state groups' `snapshots` the store API takes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _is_token_group(kinds: Mapping[str, Any], group: str) -> bool:
    kind = kinds[group]
    return bool(getattr(kind, "is_token_cache", kind))


def split_store(
    kinds: Mapping[str, Any], tokens: Sequence[int], pages: Mapping[str, Sequence[int]], page: int
) -> tuple[dict[str, list[int]], dict[str, dict[int, int]]]:
    """`kinds[group]`: a CacheKind (or anything with `is_token_cache`, or a bool)."""
    full = len(tokens) // page
    device = {g: list(p) for g, p in pages.items() if _is_token_group(kinds, g)}
    snapshots = {
        g: {full * page: p[0]} for g, p in pages.items() if not _is_token_group(kinds, g) and full
    }
    return device, snapshots
