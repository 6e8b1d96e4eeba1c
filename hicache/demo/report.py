"""What the demo prints: the progress bar, the summary and the deployment table.

`Progress` renders the engine's per-request events (a bar on a terminal, a line per tenth
otherwise); `summary_figures` flattens the engine's summary and the sidecar's counters into
the figures of the `--json` line, `render` into the summary table; `effective_table` prints the
sidecar's `/v1/config` one leaf a line with its source, `parse_effective_table` reads it back.
Pure text: no process, no file.
"""

from __future__ import annotations

import json
import time
from typing import Any, TextIO

from hicache.config import format_bytes


class Progress:
    def __init__(self, total: int, out: TextIO):
        self.total = max(total, 1)
        self.out = out
        self.tty = out.isatty()
        self.last_decile = -1
        self.started = time.perf_counter()

    def update(self, done: int, line: str) -> None:
        frac = done / self.total
        if self.tty:
            bar = "#" * int(frac * 30)
            self.out.write(f"\r[{bar:<30}] {done}/{self.total} {line[:60]:<60}")
            self.out.flush()
        elif int(frac * 10) != self.last_decile:
            self.last_decile = int(frac * 10)
            elapsed = time.perf_counter() - self.started
            self.out.write(f"  {done}/{self.total} requests ({elapsed:.1f} s)\n")

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "-"


def summary_figures(s: dict[str, Any]) -> dict[str, Any]:
    """The summary's figures, flat (the `--json` line)."""
    side = s["sidecar"]
    l3 = side.get("l3") or {}
    tokens = max(s["prompt_tokens"], 1)
    return {
        "requests": s["requests"],
        "prompt_tokens": s["prompt_tokens"],
        "hit_rate_l1": round(s["tokens_l1"] / tokens, 4),
        "hit_rate_l2": round(s["tokens_l2"] / tokens, 4),
        "hit_rate_l3": round(s["tokens_l3"] / tokens, 4),
        "tokens_computed": s["tokens_computed"],
        "store_bytes": side["backup"]["bytes"],
        "store_gbps": _gbps(side["backup"]["bytes"], side["backup"]["seconds"]),
        "load_bytes": side["load"]["bytes"],
        "load_gbps": _gbps(side["load"]["bytes"], side["load"]["seconds"]),
        "l3_put_bytes": l3.get("put_bytes", 0),
        "l3_put_gbps": _gbps(l3.get("put_bytes", 0), l3.get("put_seconds", 0.0)),
        "l3_get_bytes": l3.get("get_bytes", 0),
        "l3_get_gbps": _gbps(l3.get("get_bytes", 0), l3.get("get_seconds", 0.0)),
        "layer_waits": s["layer_waits"],
        "stall_total_ms": round(s["stall_s"] * 1e3, 3),
        "stall_p50_us": s["stall_p50_us"],
        "stall_p99_us": s["stall_p99_us"],
        "prefill_saved_s": s["prefill_saved_s"],
        "l1_evictions": s["l1_evictions"],
        "load_failed_pages": s["load_failed_pages"],
        "bytes_verified": s["bytes_verified"],
        "mismatches": s["mismatches"],
        "wall_s": round(s["wall_s"], 3),
    }


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def render(f: dict[str, Any], prefill_rate: float) -> str:
    rows = [
        ("requests", f"{f['requests']}"),
        ("prompt tokens", f"{f['prompt_tokens']}"),
        (
            "hit rate L1 / L2 / L3",
            f"{f['hit_rate_l1']:.1%} / {f['hit_rate_l2']:.1%} / {f['hit_rate_l3']:.1%}",
        ),
        ("tokens computed", f"{f['tokens_computed']}"),
        ("L1 -> L2 (store)", f"{format_bytes(f['store_bytes'])} at {f['store_gbps']:.2f} GB/s"),
        ("L2 -> L1 (load)", f"{format_bytes(f['load_bytes'])} at {f['load_gbps']:.2f} GB/s"),
        ("L2 -> L3 (persist)", f"{format_bytes(f['l3_put_bytes'])} at {f['l3_put_gbps']:.2f} GB/s"),
        ("L3 -> L2 (fetch)", f"{format_bytes(f['l3_get_bytes'])} at {f['l3_get_gbps']:.2f} GB/s"),
        (
            "per-layer stall (engine)",
            f"{f['stall_total_ms']:.2f} ms over {f['layer_waits']} layer waits, "
            f"p50 {f['stall_p50_us']:.0f} us, p99 {f['stall_p99_us']:.0f} us",
        ),
        (
            "prefill saved (est.)",
            f"{f['prefill_saved_s']:.2f} s of recompute at {prefill_rate:,.0f} tokens/s",
        ),
        ("L1 evictions", f"{f['l1_evictions']}"),
        ("L3 pages late, or missing", f"{f['load_failed_pages']}"),
        ("bytes verified", f"{f['bytes_verified']}, mismatches: {f['mismatches']}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _flatten(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(data, dict) and data:
        out: list[tuple[str, Any]] = []
        for key, value in data.items():
            out.extend(_flatten(value, f"{prefix}.{key}" if prefix else key))
        return out
    return [(prefix, data)]


def effective_table(config: dict[str, Any], sources: dict[str, str], overrides: set[str]) -> str:
    """The sidecar's `/v1/config`, one `key  value  # source` line per leaf; values the demo
    overrode say so."""
    rows = _flatten(config)
    width = max(len(k) for k, _ in rows)
    lines = []
    for key, value in rows:
        shown = json.dumps(value) if not isinstance(value, str) else value
        source = sources.get(key, "default")
        if key in overrides:
            source = "demo override"
        lines.append(f"  {key:<{width}}  {shown:<40}  # {source}")
    return "\n".join(lines)


def parse_effective_table(text: str) -> dict[str, str]:
    """key -> printed value, from `effective_table`'s lines (tests compare it with
    `/v1/config`)."""
    out = {}
    for line in text.splitlines():
        if "  # " not in line:
            continue
        left = line.split("  # ", 1)[0].strip()
        key, _, value = left.partition(" ")
        out[key] = value.strip()
    return out
