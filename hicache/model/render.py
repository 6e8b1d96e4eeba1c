"""Render a layout for people and programs: the `hicache layout` JSON contract, a table, and
a compact pattern line such as `(S×5 F)×10 S×2`.

JSON contract (outside tools depend on it; fields may be added, never renamed):
    {"model_type", "num_layers",
     "layers": [{"id", "kinds", "group", "local_id", "reuses", ...}],
     "full_attention_layer_ids",
     "rule",        # how the layout was derived, e.g. "family rule 'gemma3'" (added)
     "model_name"}  # the name page keys are seeded with, or null if not given (added)

The caller passes `model_name` (see `identity.model_identity` for the default); the table
shows it and the rule on their own lines.
"""

from __future__ import annotations

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


def layout_json(layer_map: LayerMap, model_name: str | None = None) -> dict[str, Any]:
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
            }
            for g in layer_map.groups
        ],
        "pattern": pattern_line([layout.layers[i] for i in layer_map.stage_layer_ids]),
        "rule": layout.rule,
        "model_name": model_name,
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


def layout_table(layer_map: LayerMap, model_name: str | None = None) -> str:
    data = layout_json(layer_map, model_name)
    lines = [
        f"model_type: {data['model_type']}    layers: {data['num_layers']}"
        f"    stage: {data['start_layer']}..{data['end_layer'] - 1}"
    ]
    if model_name is not None:
        lines.append(f"model_name: {model_name}")
    if data["rule"]:
        lines.append(f"rule: {data['rule']}")
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
    lines.append("groups:")
    for g in data["groups"]:
        geometry = {k: v for k, v in g.items() if k not in {"name", "kind", "layer_ids"}}
        lines.append(f"  {g['name']:<12} {len(g['layer_ids']):>3} layers  {geometry}")
    lines.append(f"full_attention_layer_ids: {data['full_attention_layer_ids']}")
    return "\n".join(lines)
