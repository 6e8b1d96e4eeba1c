"""`hicache demo`: the main job — a sidecar and a synthetic engine replaying a chat trace.

Lifecycle: validate the deployment (print it and the layout) -> start `hicache serve` on it,
scaled down for a laptop (a per-run directory for the socket and the file L3, a small host
tier so the trace spills to L3) -> start the synthetic engine process (`demo.engine`) for the
same model -> render its per-request events as a progress bar -> on its summary, read the
sidecar's metrics endpoint, SIGTERM the sidecar (it must drain and exit 0) -> print the summary
table (and with `--json` a last line of JSON) -> exit non-zero on any mismatch or failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from hicache.config import format_bytes
from hicache.demo.trace import TraceOptions
from hicache.memory import GroupGeometry
from hicache.service.process import SidecarProcess, SidecarStartError

DEMO_KV_BYTES = 96 * 2**20  # L2 for KV pages: small, so the trace spills to L3
DEMO_SNAPSHOTS = 4  # L2 state snapshots per state group (and engine slots for them)


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
    kv = max(DEMO_KV_BYTES, 8 * sum(g.page_bytes for g in tokens)) if tokens else 0
    state = DEMO_SNAPSHOTS * sum(g.page_bytes for g in states)
    # a little slack, so rounding never leaves a group a page short
    if tokens and states:
        total = kv + state + sum(g.page_bytes for g in geometries)
        return HostPlan(total, (state + sum(g.page_bytes for g in states)) / total, kv, state)
    total = (kv or state) + sum(g.page_bytes for g in geometries)
    return HostPlan(total, None, kv, state)


def demo_env(
    run_dir: Path,
    storage_kind: str,
    host_bytes: str,
    model: Path | None,
    state_fraction: float | None = None,
) -> dict[str, str]:
    """Overrides that scale the deployment down and keep this run's files in `run_dir`."""
    env = {
        "HICACHE_SERVICE__SOCKET_PATH": str(run_dir / "engine.sock"),
        "HICACHE_SERVICE__HTTP_PORT": "0",
        "HICACHE_HOST__CAPACITY_BYTES": host_bytes,
        "HICACHE_CACHE__PREFETCH_POLICY": "wait_complete",
    }
    if state_fraction is not None:
        env["HICACHE_HOST__STATE_FRACTION"] = f"{state_fraction:.6f}"
    if storage_kind == "file":
        env["HICACHE_STORAGE__PATH"] = str(run_dir / "l3")
    if model is not None:
        env["HICACHE_MODEL__CONFIG_PATH"] = str(model.resolve())
    return env


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
        ("pages L3 could not supply", f"{f['load_failed_pages']}"),
        ("bytes verified", f"{f['bytes_verified']}, mismatches: {f['mismatches']}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def run_demo(
    config: Path,
    *,
    storage_kind: str,
    model: Path | None = None,
    trace: TraceOptions | None = None,
    host_bytes: str | None = None,
    state_fraction: float | None = None,
    device_pages: int = 64,
    prefill_tokens_per_s: float = 50_000.0,
    as_json: bool = False,
    keep: bool = False,
) -> int:
    trace = trace or TraceOptions()
    run_dir = Path(tempfile.mkdtemp(prefix="hicache-demo-"))
    env = demo_env(run_dir, storage_kind, host_bytes or "128MiB", model, state_fraction)
    out = sys.stdout
    try:
        print(f"\n== sidecar: hicache serve --config {config} (run dir {run_dir})", file=out)
        sidecar = SidecarProcess(config, env=env, log_path=run_dir / "serve.log")
        try:
            sidecar.start()
        except SidecarStartError as exc:
            print(f"hicache demo: {exc}", file=sys.stderr)
            return 1
        print(f"ready: socket {sidecar.socket}, HTTP {sidecar.http}", file=out)
        try:
            summary = _drive(config, sidecar, env, trace, device_pages, prefill_tokens_per_s)
            status, metrics = sidecar.get("/metrics")
            series = sum(1 for line in metrics.splitlines() if line.startswith("hicache_"))
        finally:
            code = sidecar.stop()
        if summary is None:
            print(f"sidecar log ({run_dir / 'serve.log'}):", file=sys.stderr)
            print((run_dir / "serve.log").read_text()[-3000:], file=sys.stderr)
            return 1
        figures = summary_figures(summary)
        figures["sidecar_exit_code"] = code
        print(f"\n== summary (sidecar /metrics: HTTP {status}, {series} hicache series)", file=out)
        print(render(figures, prefill_tokens_per_s), file=out)
        if code != 0:
            print(f"hicache demo: the sidecar exited {code} on SIGTERM", file=sys.stderr)
        if as_json:
            print(json.dumps(figures), file=out)
        return 1 if figures["mismatches"] or code != 0 else 0
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def _drive(
    config: Path,
    sidecar: SidecarProcess,
    env: dict[str, str],
    trace: TraceOptions,
    device_pages: int,
    prefill_tokens_per_s: float,
) -> dict[str, Any] | None:
    args = [
        sys.executable,
        "-m",
        "hicache.demo.engine",
        "--config",
        str(config),
        "--socket",
        sidecar.socket,
        "--device-pages",
        str(device_pages),
        "--prefill-tokens-per-s",
        str(prefill_tokens_per_s),
    ]
    for name, value in asdict(trace).items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    print("\n== engine: replaying the trace", file=sys.stdout)
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}
    )
    assert proc.stdout is not None
    progress: Progress | None = None
    summary: dict[str, Any] | None = None
    for line in proc.stdout:
        event = json.loads(line)
        kind = event["event"]
        if kind == "start":
            progress = Progress(event["requests"], sys.stderr)
        elif kind == "request" and progress is not None:
            progress.update(
                event["index"] + 1,
                f"{event['name']}: {event['tokens']} tok, L1 {event['l1']} L2 {event['l2']} "
                f"L3 {event['l3']}",
            )
        elif kind == "summary":
            summary = event
    if progress is not None:
        progress.close()
    err = proc.stderr.read() if proc.stderr else ""
    if proc.wait() != 0 or summary is None:
        print(
            f"hicache demo: the engine failed ({proc.returncode}):\n{err[-3000:]}", file=sys.stderr
        )
        return None
    return summary
