"""`run_demo`: the main job — a sidecar and a synthetic engine replaying a chat trace.

Lifecycle: size the tiers from the layout and the trace (`size_tiers`: L2 by `budget_pages`,
the engine's pool; a `--host-capacity` too small is one line naming the size needed, before
anything starts) -> start `hicache serve` on the deployment, scaled down for a laptop (a
per-run directory for the socket and the file L3, a small host tier so the trace spills to
L3) -> print the deployment the sidecar runs (its `/v1/config`, also saved as
`sidecar-config.json`) -> start the synthetic engine process (`demo.engine`) for the same model
-> render its per-request events as a progress bar -> on its summary, read the sidecar's
metrics endpoint, SIGTERM the sidecar (it must drain and exit 0) -> print the summary table
(and with `--json` a last line of JSON) -> write the per-layer timeline of a few loads
(`demo.timeline`: `timeline.html` and `timeline.png` in the run directory, and at
`--timeline PATH`) -> exit non-zero on any mismatch or failure. SIGTERM / SIGINT stop the
engine and the sidecar, remove the run directory (unless `--keep`) and exit 128 + signal.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from hicache.assembly import geometries as deployment_geometries
from hicache.client.process import SidecarProcess, SidecarStartError
from hicache.config import format_bytes, load_deployment, parse_bytes
from hicache.demo import timeline as timeline_mod
from hicache.demo.timeline import LoadTimeline
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


class DemoInterrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM / SIGINT raise `DemoInterrupted` in the main thread, so the `finally` clauses
    stop the engine and the sidecar and remove the run directory."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise DemoInterrupted(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


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


def _override_keys(env: dict[str, str]) -> set[str]:
    return {
        name.removeprefix("HICACHE_").lower().replace("__", ".")
        for name in env
        if name.startswith("HICACHE_")
    }


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
    timeline: Path | None = None,
) -> int:
    trace = trace or TraceOptions()
    out = sys.stdout
    model_env = {} if model is None else {"HICACHE_MODEL__CONFIG_PATH": str(model.resolve())}
    loaded = load_deployment(config, env={**os.environ, **model_env})
    geometries = list(deployment_geometries(loaded.deployment, loaded.layer_map()).values())
    try:
        given = None if host_bytes is None else parse_bytes(host_bytes)
    except ValueError as exc:
        print(f"hicache demo: --host-capacity: {exc}", file=sys.stderr)
        return 2
    try:
        tiers = size_tiers(
            geometries,
            trace,
            geometries[0].page_size_tokens,
            host_bytes=given,
            state_fraction=state_fraction,
            device_pages=device_pages,
        )
    except DemoSizeError as exc:
        print(f"hicache demo: {exc}", file=sys.stderr)
        return 2
    if not as_json:
        for line in tiers.lines:
            print(line, file=out)
    run_dir = Path(tempfile.mkdtemp(prefix="hicache-demo-"))
    env = demo_env(run_dir, storage_kind, str(tiers.host_bytes), model, tiers.state_fraction)
    children: list[Any] = []  # the sidecar and the engine while they run
    try:
        with _interruptible():
            return _run(
                config,
                run_dir,
                env,
                dict(loaded.sources),
                children,
                trace,
                tiers,
                prefill_tokens_per_s,
                as_json,
                keep,
                timeline,
            )
    except DemoInterrupted as exc:
        print(f"\nhicache demo: {exc}: stopping the engine and the sidecar", file=sys.stderr)
        return 128 + exc.signum
    finally:
        # runs with the handlers restored: a second signal here is the default one
        for child in reversed(children):  # the engine first, then the sidecar (it drains)
            if isinstance(child, SidecarProcess):
                child.stop(timeout_s=30)
            elif child.poll() is None:
                child.kill()
                child.wait()
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def _run(
    config: Path,
    run_dir: Path,
    env: dict[str, str],
    sources: dict[str, str],
    children: list[Any],
    trace: TraceOptions,
    tiers: TierPlan,
    prefill_tokens_per_s: float,
    as_json: bool,
    keep: bool,
    timeline: Path | None,
) -> int:
    out = sys.stdout
    print(f"\n== sidecar: hicache serve --config {config} (run dir {run_dir})", file=out)
    sidecar = SidecarProcess(config, env=env, log_path=run_dir / "serve.log")
    children.append(sidecar)
    try:
        sidecar.start()
    except SidecarStartError as exc:
        print(f"hicache demo: {exc}", file=sys.stderr)
        return 1
    print(f"ready: socket {sidecar.socket}, HTTP {sidecar.http}, pid {sidecar.pid}", file=out)
    out.flush()
    out.flush()
    effective = sidecar.get_json("/v1/config")
    (run_dir / "sidecar-config.json").write_text(json.dumps(effective, indent=1))
    if not as_json:
        print("\n== deployment the sidecar runs (its /v1/config)", file=out)
        print(effective_table(effective, sources, _override_keys(env)), file=out)
    loads: list[LoadTimeline] = []
    summary = _drive(
        config, sidecar, env, trace, tiers.device_pages, prefill_tokens_per_s, children, loads
    )
    status, metrics = sidecar.get("/metrics")
    series = sum(1 for line in metrics.splitlines() if line.startswith("hicache_"))
    code = sidecar.stop()
    children.remove(sidecar)
    if summary is None:
        print(f"sidecar log ({run_dir / 'serve.log'}):", file=sys.stderr)
        print((run_dir / "serve.log").read_text()[-3000:], file=sys.stderr)
        return 1
    figures = summary_figures(summary)
    figures["sidecar_exit_code"] = code
    print(f"\n== summary (sidecar /metrics: HTTP {status}, {series} hicache series)", file=out)
    print(render(figures, prefill_tokens_per_s), file=out)
    if loads:
        shown = timeline_mod.pick(loads)
        title = f"hicache demo: per-layer load timeline ({len(shown)} of {len(loads)} loads)"
        targets = [run_dir / "timeline"] + ([timeline.with_suffix("")] if timeline else [])
        written = [timeline_mod.write(shown, base, title) for base in targets]
        kept = keep or timeline is not None
        page, png = written[-1]
        print(
            f"\n== timeline: {page} and {png}"
            + ("" if kept else " (removed with the run directory: --keep or --timeline PATH)"),
            file=out,
        )
        if kept:
            figures["timeline_html"], figures["timeline_png"] = str(page), str(png)
    if keep:
        figures["run_dir"] = str(run_dir)
    if code != 0:
        print(f"hicache demo: the sidecar exited {code} on SIGTERM", file=sys.stderr)
    if as_json:
        print(json.dumps(figures), file=out)
    return 1 if figures["mismatches"] or code != 0 else 0


def _drive(
    config: Path,
    sidecar: SidecarProcess,
    env: dict[str, str],
    trace: TraceOptions,
    device_pages: int,
    prefill_tokens_per_s: float,
    children: list[Any],
    loads: list[LoadTimeline],
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
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}
    )
    children.append(proc)
    print(f"\n== engine: replaying the trace (pid {proc.pid})", file=sys.stdout, flush=True)
    assert proc.stdout is not None
    progress: Progress | None = None
    summary: dict[str, Any] | None = None
    for line in proc.stdout:
        event = json.loads(line)
        kind = event["event"]
        if kind == "start":
            progress = Progress(event["requests"], sys.stderr)
        elif kind == "request" and progress is not None:
            if "timeline" in event:
                loads.append(timeline_mod.from_event(event))
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
    code = proc.wait()
    children.remove(proc)
    if code != 0 or summary is None:
        last = err.strip().splitlines()[-1:] or [""]
        if last[0].startswith("device pool too small"):  # the engine's own one-line refusal
            print(f"hicache demo: {last[0]} (--device-pages)", file=sys.stderr)
        else:
            print(f"hicache demo: the engine failed ({code}):\n{err[-3000:]}", file=sys.stderr)
        return None
    return summary
