"""The demo's tiers, sized from the layout and the trace, before anything starts.

`host_plan` sizes L2 from the layout alone (KV pages for a trace that spills to L3, a few
snapshots per state group); `size_tiers` checks that plan, or a `--host-capacity` given, against
the trace (`budget_pages`, what the sidecar allocates: at least `MIN_TOKEN_PAGES` per token
group and one snapshot per state group) and raises the engine's pool to the longest prompt
(`longest_prompt_pages`). A `--host-capacity` too small is a `DemoSizeError`: one line naming
the size needed. Pure: no process, no file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from hicache.config import format_bytes
from hicache.demo.trace import TraceOptions
from hicache.errors import ConfigError
from hicache.memory import GroupGeometry
from hicache.memory.host_tier import budget_pages

DEMO_KV_BYTES = 96 * 2**20  # L2 for KV pages: small, so the trace spills to L3
DEMO_SNAPSHOTS = 4  # L2 state snapshots per state group (and engine slots for them)
MIN_TOKEN_PAGES = 8  # the least L2 the demo runs with: pages per token group (and a snapshot)


@dataclass(frozen=True, slots=True)
class HostPlan:
    """The demo's L2, sized from the layout: KV pages for a spilling trace, and a few
    snapshots per state group (a large hybrid's snapshot is tens of MiB)."""

    capacity_bytes: int
    state_fraction: float | None  # None: the model has only one kind of group
    kv_bytes: int
    state_bytes: int

    def line(self) -> str:
        if self.state_fraction is None:
            return f"host tier sized from the layout: {format_bytes(self.capacity_bytes)}"
        return (
            f"host tier sized from the layout: {format_bytes(self.capacity_bytes)} = "
            f"{format_bytes(self.kv_bytes)} for KV pages + {format_bytes(self.state_bytes)} for "
            f"{DEMO_SNAPSHOTS} snapshots per state group (--host-capacity sets it)"
        )


def host_plan(geometries: Sequence[GroupGeometry]) -> HostPlan:
    tokens = [g for g in geometries if g.group.kind.is_token_cache]
    states = [g for g in geometries if not g.group.kind.is_token_cache]
    kv = max(DEMO_KV_BYTES, MIN_TOKEN_PAGES * sum(g.page_bytes for g in tokens)) if tokens else 0
    state = DEMO_SNAPSHOTS * sum(g.page_bytes for g in states)
    # a little slack, so rounding never leaves a group a page short
    if tokens and states:
        total = _whole_mib(kv + state + sum(g.page_bytes for g in geometries))
        return HostPlan(total, (state + sum(g.page_bytes for g in states)) / total, kv, state)
    total = _whole_mib((kv or state) + sum(g.page_bytes for g in geometries))
    return HostPlan(total, None, kv, state)


def _whole_mib(nbytes: int) -> int:
    """Rounded up to a whole MiB: printed exactly, and a value `--host-capacity` takes."""
    return -(-nbytes // 2**20) * 2**20


class DemoSizeError(Exception):
    """The tiers asked for cannot run the trace: one line for the user, no traceback."""


@dataclass(frozen=True, slots=True)
class TierPlan:
    """What the demo runs with: L2 bytes and state share, the engine's pool per group."""

    host_bytes: int
    state_fraction: float | None
    device_pages: int
    lines: tuple[str, ...]


def longest_prompt_pages(trace: TraceOptions, page_size_tokens: int) -> int:
    longest = max(trace.system_tokens + trace.turns * trace.turn_tokens, trace.cold_tokens)
    return -(-longest // page_size_tokens)


def size_tiers(
    geometries: Sequence[GroupGeometry],
    trace: TraceOptions,
    page_size_tokens: int,
    *,
    host_bytes: int | None = None,
    state_fraction: float | None = None,
    device_pages: int = 64,
) -> TierPlan:
    """The demo's tiers from the layout (`host_plan`) and the trace: L2 must hold the longest
    prompt's token pages and one snapshot per state group (`budget_pages`, what the sidecar
    allocates) at least `MIN_TOKEN_PAGES` per token group and one snapshot per state group; the
    engine's pool the longest prompt's pages. A `host_bytes` too small is a `DemoSizeError`
    naming `--host-capacity` and the size needed."""
    plan = host_plan(geometries)
    longest = longest_prompt_pages(trace, page_size_tokens)
    tokens = [g for g in geometries if g.group.kind.is_token_cache]
    states = [g for g in geometries if not g.group.kind.is_token_cache]
    lines: list[str] = []
    if host_bytes is None:
        host_bytes, fraction = plan.capacity_bytes, plan.state_fraction
        lines.append(plan.line())
    else:
        fraction = state_fraction if state_fraction is not None else plan.state_fraction
    # the minimum: MIN_TOKEN_PAGES per token group and one snapshot per state group
    tok_page = sum(g.page_bytes for g in tokens)
    st_page = sum(g.page_bytes for g in states)
    if tokens and states:
        assert fraction is not None
        need = max(tok_page * MIN_TOKEN_PAGES / (1 - fraction), st_page / fraction)
    else:
        need = tok_page * MIN_TOKEN_PAGES if tokens else st_page
    need_bytes = int(need) + sum(g.page_bytes for g in geometries)  # rounding slack
    need_bytes = _whole_mib(need_bytes)
    counts: dict[str, int] = {}
    with contextlib.suppress(ConfigError):  # no page of some group: `short` names it
        counts = budget_pages(list(geometries), host_bytes, fraction or 0.5)
    short = [g.name for g in tokens if counts.get(g.name, 0) < MIN_TOKEN_PAGES] + [
        g.name for g in states if counts.get(g.name, 0) < 1
    ]
    if short:
        what = ", ".join(
            f"{g.name} {format_bytes(g.page_bytes)} a "
            + ("page" if g.group.kind.is_token_cache else "snapshot")
            for g in geometries
        )
        raise DemoSizeError(
            f"--host-capacity {format_bytes(host_bytes)} cannot hold {MIN_TOKEN_PAGES} pages per "
            f"token group and one snapshot per state group ({what}); needs at least "
            f"{format_bytes(need_bytes)}, or leave it out (sized from the layout: "
            f"{format_bytes(plan.capacity_bytes)})"
        )
    pages = max(device_pages, longest + 1)
    if pages != device_pages:
        lines.append(
            f"engine pool raised to {pages} pages per token group (--device-pages "
            f"{device_pages} cannot hold the longest prompt: {longest} pages)"
        )
    return TierPlan(host_bytes, fraction if tokens and states else None, pages, tuple(lines))
