"""What L2 sizing needs, per cache group: bytes per page, and what a GiB of host memory holds
— tokens for a token group, snapshots for a state group — plus, for a deployment, how its
`host.capacity_bytes` splits (`host_tier.budget_pages`). `hicache layout` prints it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicache.memory.geometry import GroupGeometry
from hicache.memory.host_tier import budget_pages

GIB = 2**30


def sizing(
    geometries: Sequence[GroupGeometry],
    capacity_bytes: int | None = None,
    state_fraction: float = 0.25,
) -> dict[str, dict[str, Any]]:
    """Per group: kind, bytes per page, the unit a page holds, how many fit in a GiB, and with
    `capacity_bytes` the pages (and tokens or snapshots) that budget gives it."""
    counts = (
        budget_pages(list(geometries), capacity_bytes, state_fraction) if capacity_bytes else {}
    )
    out: dict[str, dict[str, Any]] = {}
    for g in geometries:
        token_group = g.group.kind.is_token_cache
        per_page = g.page_size_tokens if token_group else 1
        row: dict[str, Any] = {
            "kind": g.group.kind.value,
            "bytes_per_page": g.page_bytes,
            "unit": "tokens" if token_group else "snapshots",
            "per_gib": GIB // g.page_bytes * per_page,
        }
        if g.name in counts:
            row["l2_pages"] = counts[g.name]
            row["l2_" + row["unit"]] = counts[g.name] * per_page
        out[g.name] = row
    return out


def sizing_lines(rows: dict[str, dict[str, Any]], capacity_label: str | None) -> list[str]:
    from hicache.config.sizes import format_bytes

    head = "sizing:" + (f" (host.capacity_bytes {capacity_label})" if capacity_label else "")
    lines = [head]
    for name, r in rows.items():
        line = (
            f"  {name:<12} {r['kind']:<8} {format_bytes(r['bytes_per_page']):>10} per page, "
            f"{r['per_gib']:,} {r['unit']} per GiB of L2"
        )
        if "l2_pages" in r:
            line += f"; L2 holds {r['l2_' + r['unit']]:,} {r['unit']}"
        lines.append(line)
    return lines
