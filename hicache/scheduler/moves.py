"""Which pages of each group an op moves: the hybrid-aware rules, pure Python.

For a load of a prefix of T tokens (pages of P tokens):
- full-attention and MLA groups, and sparse groups (with their index K / K+V): every page;
- sliding-window groups (window W): only pages holding tokens [T - W, T);
- chunked groups (chunk C): only the current chunk, tokens [floor(T / C) * C, T);
- linear / mamba / conv groups: the one state-snapshot page (a backup may carry several:
  one per prefix length the engine kept a snapshot for).
`full_attention_only` moves full-attention groups alone (the plain `is_full_attention_layer`
filter), for engines that recompute everything else (the cache then keeps no other group:
`moves_group`). Backups store what they are given.
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


def moves_group(policy: MovePolicy, group: CacheGroup) -> bool:
    """Does an op under `policy` move this group at all? (`full_attention_only`: only full
    attention; the engine recomputes the rest, so a cache never stores or needs it.)"""
    return policy == "hybrid" or group.kind is CacheKind.FULL


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
    num_tokens: int | None,
    page_size_tokens: int,
    policy: MovePolicy,
    for_load: bool,
    first_page: int = 0,
) -> Selection:
    """Which of the `num_pages` pages given (pages `first_page`.. of the prompt) move."""
    everything = tuple(range(num_pages))
    if first_page < 0:
        raise OpRequestError(f"group {group.name!r}: first_page {first_page} is negative")
    if not moves_group(policy, group):
        return Selection((), everything)
    if not group.kind.is_token_cache:
        if for_load and num_pages != 1:
            raise OpRequestError(
                f"group {group.name!r} is a {group.kind.description} state group: a load moves "
                f"exactly one snapshot page of it (the state at the hit); got {num_pages}"
            )
        return Selection(everything, ())  # a backup: one page per snapshot the engine kept
    if not for_load:
        return Selection(everything, ())
    windowed = group.kind in (CacheKind.SLIDING, CacheKind.CHUNKED)
    if num_tokens is None:
        if windowed:
            raise OpRequestError(
                f"group {group.name!r} is a {group.spec.describe()} group: a load must say "
                "num_tokens (the prefix length it serves), which decides the pages its "
                f"{'window' if group.kind is CacheKind.SLIDING else 'chunk'} needs"
            )
        return Selection(everything, ())
    end_page = first_page + num_pages
    if not (end_page - 1) * page_size_tokens < num_tokens <= end_page * page_size_tokens:
        raise OpRequestError(
            f"group {group.name!r}: num_tokens {num_tokens} does not end in the last of the "
            f"pages given (prompt pages {first_page}..{end_page - 1} of {page_size_tokens} "
            f"tokens); allowed: {(end_page - 1) * page_size_tokens + 1}.."
            f"{end_page * page_size_tokens}"
        )
    first = first_needed_token(group, num_tokens) // page_size_tokens
    if first * page_size_tokens >= num_tokens:  # chunked: a fresh chunk needs nothing
        first = end_page
    positions = tuple(i for i in everything if first_page + i >= first)
    return Selection(positions, tuple(i for i in everything if first_page + i < first))
