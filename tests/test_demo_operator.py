"""`hicache demo` as a new user meets it: tiers sized from the layout for every model (or one
line naming `--host-capacity` and the size needed), the deployment table equal to what the
sidecar runs, SIGTERM / SIGINT leaving nothing behind, and the per-layer timeline files."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.assembly import geometries
from hicache.config import format_bytes, load_deployment, parse_bytes
from hicache.demo import plotting
from hicache.demo.run import (
    MIN_TOKEN_PAGES,
    DemoSizeError,
    host_plan,
    longest_prompt_pages,
    parse_effective_table,
    size_tiers,
)
from hicache.demo.trace import TraceOptions
from hicache.memory import GroupGeometry
from hicache.memory.host_tier import budget_pages
from tests.conftest import CONFIGS, REPO, shared_model

SMALL = ["--conversations", "3", "--turns", "2", "--cold-requests", "1"]


def _geometries(model: Path) -> tuple[list[GroupGeometry], int]:
    env = {**os.environ, "HICACHE_MODEL__CONFIG_PATH": str(model)}
    loaded = load_deployment(CONFIGS / "default.yaml", env=env)
    d = loaded.deployment
    return list(geometries(d, loaded.layer_map()).values()), d.model.page_size_tokens


def _models() -> list[Path]:
    seen: dict[bytes, Path] = {}
    for path in sorted((CONFIGS / "models").glob("*.json")):
        seen.setdefault(path.read_bytes(), path)
    return sorted(seen.values())


@pytest.mark.parametrize("model", _models(), ids=lambda p: p.stem)
def test_tiers_sized_from_the_layout_hold_the_trace_for_every_model(model: Path) -> None:
    geometries, page = _geometries(model)
    trace = TraceOptions()
    tiers = size_tiers(geometries, trace, page)
    counts = budget_pages(geometries, tiers.host_bytes, tiers.state_fraction or 0.5)
    longest = longest_prompt_pages(trace, page)
    for g in geometries:  # what the sidecar allocates: some pages and a snapshot per group
        assert counts[g.name] >= (MIN_TOKEN_PAGES if g.group.kind.is_token_cache else 1), g.name
    assert tiers.device_pages > longest
    # too small: one line naming the flag and a size that is enough
    with pytest.raises(DemoSizeError) as caught:
        size_tiers(geometries, trace, page, host_bytes=2**20)
    message = str(caught.value)
    assert "--host-capacity" in message
    assert "\n" not in message
    need = re.search(r"needs at least (\S+),", message)
    assert need is not None, message
    size_tiers(geometries, trace, page, host_bytes=parse_bytes(need.group(1)))
    assert tiers.host_bytes == host_plan(geometries).capacity_bytes


def test_too_small_host_capacity_is_one_line_naming_the_flag() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hicache",
            "demo",
            "--model",
            str(shared_model("qwen3_next_80b.json")),
            "--host-capacity",
            "32MiB",
            *SMALL,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "--host-capacity 32MiB" in lines[0]
    assert "needs at least" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert "== sidecar" not in result.stdout  # nothing was started


def test_state_hybrid_at_the_defaults_prints_what_the_sidecar_runs_and_a_timeline() -> None:
    """Qwen3-Next (linear attention + full): a 37 MiB snapshot per sequence, tiers sized from
    the layout; the printed deployment is the sidecar's own /v1/config; the timeline files are
    kept with --keep and are valid."""
    model = shared_model("qwen3_next_80b.json")
    result = subprocess.run(
        [sys.executable, "-m", "hicache", "demo", "--model", str(model), "--keep", *SMALL],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    out = result.stdout
    run_dir = Path(re.search(r"\(run dir (\S+)\)", out).group(1))  # type: ignore[union-attr]
    try:
        assert "mismatches: 0" in out
        table = out.split("== deployment the sidecar runs", 1)[1].split("== engine", 1)[0]
        printed = parse_effective_table(table)
        config = json.loads((run_dir / "sidecar-config.json").read_text())
        flat = {
            f"{section}.{key}": value
            for section, values in config.items()
            for key, value in values.items()
        }
        assert printed.keys() == flat.keys()
        for key, value in flat.items():
            shown = value if isinstance(value, str) else json.dumps(value)
            assert printed[key] == shown, key
        geometries, page = _geometries(model)
        tiers = size_tiers(geometries, TraceOptions(conversations=3, turns=2), page)
        assert parse_bytes(flat["host.capacity_bytes"]) == tiers.host_bytes
        assert printed["host.capacity_bytes"] == format_bytes(tiers.host_bytes)
        assert printed["storage.path"] == str(run_dir / "l3")
        assert printed["cache.prefetch_policy"] == "wait_complete"
        port = re.search(r"HTTP http://127\.0\.0\.1:(\d+)", out)
        assert port is not None
        assert int(port.group(1)) > 0
        # the timeline (drawn with matplotlib where it is installed; else one line saying how)
        if not plotting.available():
            assert "== timeline: not drawn (matplotlib is not installed): pip install" in out
            assert not (run_dir / "timeline.png").exists()
            return
        assert f"== timeline: {run_dir / 'timeline.html'}" in out
        html = (run_dir / "timeline.html").read_text()
        _check_png((run_dir / "timeline.png").read_bytes())
        assert html.count("<svg") == 1
        panels = re.findall(r'<g id="load-(\d+)-copy">(.*?)</g>', html, re.S)
        assert 1 <= len(panels) <= 4
        layers = len([g for g in geometries for _ in range(g.num_layers)])
        for _, bars in panels:  # one copy bar per layer of the model, in every load shown
            assert bars.count("<path") == layers
    finally:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)


def _check_png(png: bytes) -> None:
    """A valid PNG (Pillow, matplotlib's dependency, decodes it), wide, in several colours."""
    import io

    from PIL import Image

    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    Image.open(io.BytesIO(png)).verify()
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.size[0] >= 800
    colors = image.getcolors(maxcolors=1 << 20) or []
    assert len(colors) >= 3  # background, copy and compute at least


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_stops_the_engine_and_the_sidecar_and_removes_the_run_dir(
    sig: signal.Signals,
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache", "demo", "--conversations", "400", "--turns", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    run_dir = sidecar = engine = None
    try:
        for line in proc.stdout:
            if m := re.search(r"\(run dir (\S+)\)", line):
                run_dir = Path(m.group(1))
            if m := re.search(r"^ready: .* pid (\d+)", line):
                sidecar = int(m.group(1))
            if m := re.search(r"== engine: .*\(pid (\d+)\)", line):
                engine = int(m.group(1))
                break
        assert run_dir is not None
        assert sidecar is not None
        assert engine is not None
        assert run_dir.is_dir()
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + sig
    assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")
    for pid in (sidecar, engine):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not run_dir.exists()
