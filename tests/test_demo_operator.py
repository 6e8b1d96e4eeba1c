"""`hicache demo` as a new user meets it: tiers sized from the layout for every model (or one
line naming `--host-capacity` and the size needed), the deployment table equal to what the
sidecar runs, SIGTERM / SIGINT leaving nothing behind, and the per-layer timeline files."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from hicache.assembly import geometries
from hicache.config import format_bytes, load_deployment, parse_bytes
from hicache.demo.run import (
    MIN_TOKEN_PAGES,
    DemoSizeError,
    host_plan,
    longest_prompt_pages,
    parse_effective_table,
    size_tiers,
)
from hicache.demo.timeline import LayerSpan, LoadTimeline, render_html, render_png
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
        # the timeline
        assert f"== timeline: {run_dir / 'timeline.html'}" in out
        html = (run_dir / "timeline.html").read_text()
        png = (run_dir / "timeline.png").read_bytes()
        _check_png(png)
        assert html.count("<svg") == 1
        loads = html.count('class="load"')
        assert 1 <= loads <= 4
        assert html.count('class="layer"') == loads * len(
            [g for g in geometries for _ in range(g.num_layers)]
        )
    finally:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)


def _check_png(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", png[8:16])
    assert kind == b"IHDR"
    assert length == 13
    width, height, depth, color = struct.unpack(">IIBB", png[16:26])
    assert (depth, color) == (8, 2)
    assert struct.unpack(">I", png[29:33])[0] == zlib.crc32(png[12:29])
    # decode the one IDAT: rows of a filter byte and RGB pixels, more than background
    idat = png.index(b"IDAT")
    size = struct.unpack(">I", png[idat - 4 : idat])[0]
    raw = zlib.decompress(png[idat + 4 : idat + 4 + size])
    assert len(raw) == height * (1 + 3 * width)
    colors = {raw[i : i + 3] for i in range(1, len(raw) - 3, 3 * 7)}
    assert len(colors) >= 3  # background, copy and compute at least
    return width, height


def test_timeline_renders_one_element_per_layer_and_a_valid_png() -> None:
    spans = [
        LayerSpan(
            i, i * 1e-4, (i + 1) * 1e-4, i * 1e-4 + (5e-5 if i == 2 else 1e-4), (i + 2) * 1e-4
        )
        for i in range(10)
    ]
    loads = [LoadTimeline("conv0/turn1", "L2 64 + L3 0 tokens loaded", spans)]
    html = render_html(loads, "t")
    assert html.count('class="layer"') == 10
    assert html.count('class="stall"') == 1  # only layer 2 waited longer than the mark
    width, height = _check_png(render_png(loads))
    assert width > 100
    assert height >= 10 * 8


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
