"""`run_demo`: the main job — a sidecar and a synthetic engine replaying a chat trace.

Lifecycle: size the tiers from the layout and the trace (`sizing.size_tiers`: L2 by
`budget_pages`, the engine's pool; a `--host-capacity` too small is one line naming the size
needed, before anything starts) -> start `hicache serve` on the deployment, scaled down for a
laptop (a per-run directory for the socket and the file L3, a small host tier so the trace
spills to L3) -> print the deployment the sidecar runs (its `/v1/config`, also saved as
`sidecar-config.json`) -> start the synthetic engine process (`demo.engine`) for the same model
-> render its per-request events as a progress bar -> on its summary, read the sidecar's
metrics endpoint, SIGTERM the sidecar (it must drain and exit 0) -> print the summary table
(and with `--json` a last line of JSON; the text in `demo.report`) -> write the per-layer
timeline of a few loads (`demo.timeline`: `timeline.html` and `timeline.png` in the run
directory, and at `--timeline PATH`; without matplotlib, one line saying how to get them, and
`--timeline PATH` refused before anything starts) -> exit non-zero on any mismatch or failure.
SIGTERM / SIGINT stop the engine and the sidecar, remove the run directory (unless `--keep`)
and exit 128 + signal.
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
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hicache.assembly import geometries as deployment_geometries
from hicache.client.process import SidecarProcess, SidecarStartError
from hicache.config import load_deployment, parse_bytes
from hicache.demo import plotting
from hicache.demo import timeline as timeline_mod
from hicache.demo.report import (
    Progress,
    effective_table,
    parse_effective_table,
    render,
    summary_figures,
)
from hicache.demo.sizing import (
    MIN_TOKEN_PAGES,
    DemoSizeError,
    TierPlan,
    host_plan,
    longest_prompt_pages,
    size_tiers,
)
from hicache.demo.timeline import LoadTimeline
from hicache.demo.trace import TraceOptions

# the sizing and the report live in sizing.py and report.py; their names tests read are
# re-exported here
__all__ = [
    "MIN_TOKEN_PAGES",
    "DemoInterrupted",
    "DemoSizeError",
    "demo_env",
    "host_plan",
    "longest_prompt_pages",
    "parse_effective_table",
    "run_demo",
    "size_tiers",
]


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
    if timeline is not None and not plotting.available():
        print(
            f"hicache demo: --timeline {timeline}: the timeline is drawn with matplotlib, which "
            f"is not installed here: {plotting.INSTALL_HINT}",
            file=sys.stderr,
        )
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
        _write_timeline(loads, run_dir, timeline, keep, figures)
    if keep:
        figures["run_dir"] = str(run_dir)
    if code != 0:
        print(f"hicache demo: the sidecar exited {code} on SIGTERM", file=sys.stderr)
    if as_json:
        print(json.dumps(figures), file=out)
    return 1 if figures["mismatches"] or code != 0 else 0


def _write_timeline(
    loads: list[LoadTimeline],
    run_dir: Path,
    timeline: Path | None,
    keep: bool,
    figures: dict[str, Any],
) -> None:
    out = sys.stdout
    if not plotting.available():
        print(
            f"\n== timeline: not drawn (matplotlib is not installed): {plotting.INSTALL_HINT}",
            file=out,
        )
        return
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
