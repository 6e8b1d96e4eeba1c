"""What a store or a load names, checked before anything is reserved, pinned or moved.

`store_positions` turns a store's arguments into (page position, device page) pairs per
group: token groups list a device page per full page (None where the engine no longer holds
it: never stored), state groups their snapshots `{num_tokens: slot}` (a snapshot for n tokens
is the group's page n / page_size - 1). `check_load_pages` checks a load's device pages. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hicache.index import GroupRule
from hicache.scheduler import OpRequestError


def store_positions(
    rules: Mapping[str, GroupRule],
    page_size_tokens: int,
    device_pages: Mapping[str, Sequence[int | None]],
    snapshots: Mapping[str, Mapping[int, int]],
    full_pages: int,
) -> dict[str, list[tuple[int, int]]]:
    """(page position, device page) per group that a store may back up, checked before
    anything is pinned or moved. A state group's snapshot for n tokens is its page
    n / page_size - 1 (keyed by the prompt's key of that page)."""
    size = page_size_tokens
    groups = sorted(rules)
    for group in (*device_pages, *snapshots):
        if group not in rules:
            raise OpRequestError(
                f"store names group {group!r}, which is not in the layout; groups: {groups}"
            )
    out: dict[str, list[tuple[int, int]]] = {}
    for group, rule in rules.items():
        if rule.kind.is_token_cache:
            if group in snapshots:
                raise OpRequestError(
                    f"snapshots.{group}: {group!r} is a {rule.kind.description} group; "
                    "its pages go in device_pages, snapshots are for state groups"
                )
            given = device_pages.get(group)
            if given is None:
                token_groups = [g for g in groups if rules[g].kind.is_token_cache]
                raise OpRequestError(
                    f"device_pages has no group {group!r}; every token group of the layout "
                    f"({', '.join(token_groups)}) lists its pages (None for a page the "
                    "engine no longer holds)"
                )
            if len(given) < full_pages:
                raise OpRequestError(
                    f"device_pages.{group}: {len(given)} pages given; the prompt's "
                    f"{full_pages} full pages need {full_pages} entries (None for a page "
                    "the engine no longer holds)"
                )
            out[group] = [(i, d) for i, d in enumerate(given[:full_pages]) if d is not None]
            continue
        if group in device_pages:
            raise OpRequestError(
                f"device_pages.{group}: {group!r} is a {rule.kind.description} state group; "
                "a store gives its snapshots as snapshots={group: {num_tokens: slot}}, "
                "saying how many tokens each snapshot covers"
            )
        wanted = []
        for tokens, slot in sorted(snapshots.get(group, {}).items()):
            if tokens % size or not 0 < tokens <= full_pages * size:
                raise OpRequestError(
                    f"snapshots.{group}: a snapshot after {tokens} tokens cannot be keyed; "
                    f"allowed: a multiple of the page size ({size}) in {size}.."
                    f"{full_pages * size} (the prompt's full pages)"
                )
            wanted.append((tokens // size - 1, slot))
        out[group] = wanted
    return out


def check_load_pages(
    rules: Mapping[str, GroupRule], device_pages: Mapping[str, Sequence[int]], pages: int
) -> None:
    """A load's device pages: every group lists a page per full page of the prompt (state
    groups: the one slot the snapshot lands in), before anything is pinned or moved."""
    for group, rule in rules.items():
        given = device_pages.get(group)
        if given is None:
            raise OpRequestError(
                f"device_pages has no group {group!r}; the layout's groups are {sorted(rules)}"
            )
        need = pages if rule.kind.is_token_cache else min(pages, 1)
        if len(given) < need:
            raise OpRequestError(
                f"device_pages.{group}: {len(given)} pages given; the prompt's {pages} full "
                f"pages need {need}" + ("" if rule.kind.is_token_cache else " snapshot page")
            )
