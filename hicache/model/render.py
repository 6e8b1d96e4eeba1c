"""Render a layout for people and programs: the `hicache layout` JSON contract, a table, and
a compact pattern line such as `(S×5 F)×10 S×2`.

JSON contract (outside tools depend on it; fields may be added, never renamed):
    {"model_type", "num_layers",
     "layers": [{"id", "kinds", "group", "local_id", "reuses", ...}],
     "full_attention_layer_ids",
     "rule",        # how the layout was derived, e.g. "family rule 'gemma3'" (added)
     "model_name",  # the name page keys are seeded with, or null if not given (added)
     "tp_size",     # the tensor-parallel size the specs are one rank's share of (added)
     "start_layer", "end_layer",  # the stage: start inclusive, end exclusive
     "groups": [{"name", "kind", "layer_ids", <the spec's fields>,
                 "replicated",  # the same on every TP rank: stored once in L3 (added)
                 # with `sizing` (added): "page_bytes", "page_size_tokens", "unit",
                 # "tokens_per_gib" (token groups, else null), "snapshots_per_gib" (state
                 # groups, else null)
                }]}

The caller passes `model_name` (see `identity.model_identity` for the default) and, to show
what a page costs, `sizing` (`memory.sizing.sizing`: this package has no torch to compute it);
the table shows the name and the rule on their own lines and the groups as a table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hicache.model.layer_map import LayerMap
from hicache.model.specs import CacheKind, LayerSpec

_SYMBOL = {
    CacheKind.FULL: "F",
    CacheKind.SLIDING: "S",
    CacheKind.CHUNKED: "C",
    CacheKind.SPARSE: "X",
    CacheKind.LINEAR: "L",
    CacheKind.MAMBA: "M",
    CacheKind.CONV: "V",
}
LEGEND = (
    "F full, S sliding, C chunked, X sparse, L linear, M mamba, V conv, "
    "- no cache, R reuses another layer's KV, + two caches"
)


def _primary_slot_index(layer: LayerSpec) -> int:
    """The cache reported as a layer's `group`: its attention cache if it has one."""
    for i, cache in enumerate(layer.caches):
        if cache.kind.is_token_cache:
            return i
    return 0


def _group_sizing(row: Mapping[str, Any] | None, page_size_tokens: int | None) -> dict[str, Any]:
    if row is None:
        return {}
    token_group = row["unit"] == "tokens"
    return {
        "page_bytes": row["bytes_per_page"],
        "page_size_tokens": page_size_tokens if token_group else None,
        "unit": row["unit"],
        "tokens_per_gib": row["per_gib"] if token_group else None,
        "snapshots_per_gib": None if token_group else row["per_gib"],
    }


def layout_json(
    layer_map: LayerMap,
    model_name: str | None = None,
    sizing: Mapping[str, Mapping[str, Any]] | None = None,
    page_size_tokens: int | None = None,
) -> dict[str, Any]:
    """The JSON contract (module docstring); `sizing` adds each group's page bytes and what a
    GiB of L2 holds, `page_size_tokens` the page size that sizing assumed."""
    layout = layer_map.layout
    layers = []
    for layer_id in layer_map.stage_layer_ids:
        layer = layout.layers[layer_id]
        slots = layer_map.slots(layer_id)
        by_kind = {s.group.kind: s for s in slots}
        primary = by_kind[layer.caches[_primary_slot_index(layer)].kind] if slots else None
        layers.append(
            {
                "id": layer_id,
                "kinds": [k.value for k in layer.kinds],
                "group": primary.group.name if primary else None,
                "local_id": primary.local_id if primary else None,
                "reuses": layer.reuses,
                "groups": [
                    {"group": by_kind[c.kind].group.name, "local_id": by_kind[c.kind].local_id}
                    for c in layer.caches
                ],
                "caches": [c.to_json() for c in layer.caches],
            }
        )
    in_stage = [i for i in layout.full_attention_layer_ids if i in layer_map.stage_layer_ids]
    return {
        "model_type": layout.model_type,
        "num_layers": layout.num_layers,
        "start_layer": layer_map.start_layer,
        "end_layer": layer_map.end_layer,
        "layers": layers,
        "full_attention_layer_ids": in_stage,
        "groups": [
            {
                "name": g.name,
                "kind": g.kind.value,
                "layer_ids": list(g.layer_ids),
                **g.spec.to_json(),
                "replicated": g.replicated,
                **_group_sizing((sizing or {}).get(g.name), page_size_tokens),
            }
            for g in layer_map.groups
        ],
        "pattern": pattern_line([layout.layers[i] for i in layer_map.stage_layer_ids]),
        "rule": layout.rule,
        "model_name": model_name,
        "tp_size": layout.tp_size,
    }


def layer_symbol(layer: LayerSpec) -> str:
    if layer.reuses is not None:
        return "R"
    if not layer.caches:
        return "-"
    return "+".join(_SYMBOL[k] for k in layer.kinds)


def _runs(symbols: list[str]) -> str:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        j = i
        while j < len(symbols) and symbols[j] == symbols[i]:
            j += 1
        out.append(symbols[i] if j - i == 1 else f"{symbols[i]}×{j - i}")
        i = j
    return " ".join(out)


def pattern_line(layers: list[LayerSpec]) -> str:
    """Run-length pattern; a repeating unit is shown once with its count."""
    symbols = [layer_symbol(layer) for layer in layers]
    n = len(symbols)
    for period in range(1, n // 2 + 1):
        if all(symbols[i] == symbols[i % period] for i in range(n)):
            if period == 1:
                return f"{symbols[0]}×{n}"
            reps, tail = divmod(n, period)
            line = f"({_runs(symbols[:period])})×{reps}"
            return line + (f" {_runs(symbols[:tail])}" if tail else "")
    return _runs(symbols)


def stage_line(start_layer: int, end_layer: int) -> str:
    """The stage as `--start-layer` / `--end-layer` take it: start inclusive, end exclusive."""
    if end_layer <= start_layer:
        return f"stage: no layers (start {start_layer}, end {end_layer} exclusive)"
    return f"stage: layers {start_layer}..{end_layer - 1} (end exclusive: {end_layer})"


def _shape(value: object) -> str:
    if isinstance(value, list):
        return "×".join(str(v) for v in value)
    if isinstance(value, dict):
        return ",".join(f"{k}:{_shape(v)}" for k, v in value.items())
    return str(value)


def geometry_text(spec_json: Mapping[str, Any]) -> str:
    """A cache spec's fields as `name=value` words (no Python reprs)."""
    parts = []
    for key, value in spec_json.items():
        if key == "kind" or value is None or (key == "replicated" and not value):
            continue  # "replicated" shown only where true
        parts.append(f"{key}={_shape(value)}")
    return " ".join(parts)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            shown = n / size
            return f"{shown:.0f} {unit}" if shown == int(shown) else f"{shown:.1f} {unit}"
    return f"{n} B"


def groups_table(
    groups: list[dict[str, Any]], l2_holds: Mapping[str, str] | None = None
) -> list[str]:
    """The groups as aligned columns: name, kind, layers, page bytes, what a GiB of L2 holds
    (when sized), the geometry; `l2_holds` adds what a deployment's L2 budget holds."""
    sized = any("page_bytes" in g for g in groups)
    head = ["group", "kind", "layers"]
    if sized:
        head += ["page bytes", "per GiB of L2"]
    if l2_holds:
        head += ["L2 holds"]
    head += ["geometry"]
    rows = [head]
    for g in groups:
        row = [g["name"], g["kind"], str(len(g["layer_ids"]))]
        if sized:
            per_gib = g["tokens_per_gib"] if g["unit"] == "tokens" else g["snapshots_per_gib"]
            row += [_bytes(g["page_bytes"]), f"{per_gib:,} {g['unit']}"]
        if l2_holds:
            row += [l2_holds.get(g["name"], "-")]
        extra = {"kind", "layer_ids", "name", "page_bytes", "page_size_tokens", "unit"}
        extra |= {"tokens_per_gib", "snapshots_per_gib"}
        row += [geometry_text({k: v for k, v in g.items() if k not in extra})]
        rows.append(row)
    numeric = {"layers", "page bytes", "per GiB of L2", "L2 holds"}
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = []
    for r in rows:
        cells = [
            cell.rjust(w) if name in numeric else cell.ljust(w)
            for cell, w, name in zip(r, widths, head, strict=True)
        ]
        out.append(("  " + "  ".join(cells)).rstrip())
    return out


def layout_table(
    layer_map: LayerMap,
    model_name: str | None = None,
    sizing: Mapping[str, Mapping[str, Any]] | None = None,
    page_size_tokens: int | None = None,
    sizing_note: str = "",
    l2_holds: Mapping[str, str] | None = None,
) -> str:
    """The text form: header lines, one row per layer, then the groups table (with page bytes
    and what a GiB of L2 holds when `sizing` is given; `sizing_note` heads it)."""
    data = layout_json(layer_map, model_name, sizing, page_size_tokens)
    lines = [
        f"model_type: {data['model_type']}    layers: {data['num_layers']}"
        f"    {stage_line(data['start_layer'], data['end_layer'])}"
    ]
    if model_name is not None:
        lines.append(f"model_name: {model_name}")
    if data["rule"]:
        lines.append(f"rule: {data['rule']}")
    if data["tp_size"] > 1:
        shared = [g["name"] for g in data["groups"] if g["replicated"]]
        lines.append(
            f"tensor parallel: one rank of tp_size {data['tp_size']} (heads and page bytes per "
            "rank); stored once for all ranks: " + (", ".join(shared) or "none")
        )
    lines += [
        f"pattern: {data['pattern']}    ({LEGEND})",
        "",
        f"{'id':>4}  {'kinds':<14} {'group':<12} {'local':>5}  detail",
    ]
    for row, layer_id in zip(data["layers"], layer_map.stage_layer_ids, strict=True):
        layer = layer_map.layout.layers[layer_id]
        detail = layer.describe() if layer.caches or layer.reuses is not None else "no cache"
        local = "" if row["local_id"] is None else str(row["local_id"])
        kinds = "+".join(row["kinds"]) or "-"
        lines.append(f"{row['id']:>4}  {kinds:<14} {row['group'] or '-':<12} {local:>5}  {detail}")
    lines.append("")
    lines.append("groups:" + (f" {sizing_note}" if sizing_note else ""))
    lines += groups_table(data["groups"], l2_holds)
    ids = ", ".join(str(i) for i in data["full_attention_layer_ids"]) or "none"
    lines.append(f"full_attention_layer_ids: {ids}")
    return "\n".join(lines)
