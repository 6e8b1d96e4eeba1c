"""Which pages of each group an op moves: the hybrid-aware rules, pure Python.

For a load of a prefix of T tokens (pages of P tokens):
- full-attention and MLA groups, and sparse groups (with their index K / K+V): every page;
- sliding-window groups (window W): only pages holding tokens [T - W, T);
- chunked groups (chunk C): only the current chunk, tokens [floor(T / C) * C, T);
- linear / mamba / conv groups: the one state-snapshot page.
`full_attention_only` moves full-attention groups alone (the plain `is_full_attention_layer`
filter), for engines that recompute everything else. Backups store what they are given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hicache.errors import HicacheError
from hicache.model import CacheGroup, CacheKind

MovePolicy = Literal["hybrid", "full_attention_only"]


class OpRequestError(HicacheError, ValueError):
    """An op's request is malformed: unknown group, mismatched pages, bad token count."""


@dataclass(frozen=True, slots=True)
class Selection:
    positions: tuple[int, ...]  # indices into the group's page list that move
    skipped: tuple[int, ...]


def first_needed_token(group: CacheGroup, num_tokens: int) -> int:
    spec = group.spec
    if spec.kind is CacheKind.SLIDING:
        assert spec.window_tokens is not None
        return max(0, num_tokens - spec.window_tokens)
    if spec.kind is CacheKind.CHUNKED:
        assert spec.chunk_tokens is not None
        return (num_tokens // spec.chunk_tokens) * spec.chunk_tokens
    return 0


def select(
    group: CacheGroup,
    num_pages: int,
    num_tokens: int,
    page_size_tokens: int,
    policy: MovePolicy,
    for_load: bool,
) -> Selection:
    everything = tuple(range(num_pages))
    if policy == "full_attention_only" and group.kind is not CacheKind.FULL:
        return Selection((), everything)
    if not group.kind.is_token_cache:
        if num_pages != 1:
            raise OpRequestError(
                f"group {group.name!r} is a {group.kind.description} state group: an op moves "
                f"exactly one snapshot page of it; got {num_pages}"
            )
        return Selection(everything, ())
    if not for_load:
        return Selection(everything, ())
    if not (num_pages - 1) * page_size_tokens < num_tokens <= num_pages * page_size_tokens:
        raise OpRequestError(
            f"group {group.name!r}: num_tokens {num_tokens} does not fit {num_pages} pages of "
            f"{page_size_tokens} tokens; allowed: {(num_pages - 1) * page_size_tokens + 1}.."
            f"{num_pages * page_size_tokens}"
        )
    first = first_needed_token(group, num_tokens) // page_size_tokens
    if first * page_size_tokens >= num_tokens:  # chunked: a fresh chunk needs nothing
        first = num_pages
    return Selection(tuple(range(first, num_pages)), tuple(range(first)))
