"""`hicache stats` against a real sidecar: one frame (`--once`), one JSON object (`--json`),
the address from `--config`, and a clear error naming the URL when nothing answers."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

from hicache.cli.stats import CLEAR, Metrics, quantile
from hicache.client.process import SidecarProcess
from tests.conftest import REPO
from tests.service.conftest import engine, engine_result, wait_persisted, write_config


def stats(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicache", "stats", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_once_and_json_read_a_running_sidecar(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    with SidecarProcess(config) as proc:
        assert engine_result(engine("roundtrip", config, "--prompts", "2"))["mismatches"] == 0
        wait_persisted(proc, 1)  # L3 is written behind the acked stores: `stored` counts it
        once = stats("--url", proc.http, "--once")
        assert once.returncode == 0, once.stderr
        frame = once.stdout
        assert frame.startswith(f"hicache stats  {proc.http}  ")
        assert "\x1b[" not in frame  # --once draws no screen control codes
        assert "hit rate (tokens looked up: " in frame
        assert "queue depth: loads 0  backups 0" in frame
        assert "layer stalls (" in frame
        assert "namespaces 1 (running: " in frame  # its phase and sessions (the registry's)
        assert "L3 (file): breaker closed" in frame
        assert "L2 per group:" in frame
        assert "{" not in frame  # a table, not Python reprs
        as_json = stats("--url", proc.http, "--json")
        assert as_json.returncode == 0, as_json.stderr
        data = json.loads(as_json.stdout)
        assert [state.split(":")[0] for state in data["namespace_states"]] == ["running"]
        full = next(g for g in data["l2"] if g["group"] == "full")
        assert full["pages"] > 0
        assert full["capacity_pages"] >= full["pages"]
        assert 0 < full["use"] <= 1
        rates = data["hit_rate_tokens"]
        assert set(rates) == {"l2", "l3", "miss"}
        if sum(data["lookup_tokens"].values()):  # this engine loads without a lookup op
            assert abs(sum(rates.values()) - 1) < 1e-9
        else:
            assert rates == {"l2": None, "l3": None, "miss": None}
        assert data["l3"]["breaker"] == "closed"
        assert data["l3"]["kind"] == "file"
        assert data["l3"]["stored"] > 0
        assert data["queue_depth"] == {"load": 0, "backup": 0}
        stalls = data["layer_stall_seconds"]  # engines report them; this one does not
        assert {"count", "sum", "p50", "p90", "p99"} <= set(stalls)
        assert stalls["count"] > 0 or stalls["p50"] is None
        # the address from the deployment file: service.http_host / http_port
        port = proc.http.rsplit(":", 1)[1]
        (tmp_path / "again").mkdir()
        pinned = write_config(tmp_path / "again", http_port=int(port))
        by_config = stats("--config", str(pinned), "--json")
        assert by_config.returncode == 0, by_config.stderr
        assert json.loads(by_config.stdout)["url"] == proc.http
        # live: the frame redrawn in place until Ctrl-C, which ends it quietly
        live = subprocess.Popen(
            [sys.executable, "-m", "hicache", "stats", "--url", proc.http, "--interval", "0.2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            # as a terminal starts it: a suite launched in the background (`pytest &` from a
            # script) has SIGINT ignored, its children inherit that, and Python then never
            # turns Ctrl-C into KeyboardInterrupt (the command ran on past its SIGINT)
            preexec_fn=_default_sigint,
        )
        assert live.stdout is not None
        seen = b""
        while seen.count(CLEAR.encode()) < 2:
            chunk = live.stdout.read1(65536)
            assert chunk, live.communicate(timeout=10)
            seen += chunk
        live.send_signal(signal.SIGINT)
        _, err = live.communicate(timeout=30)
        assert live.returncode == 0, err
        assert err == b""
        assert b"(every 0.2s, Ctrl-C to stop)" in seen


def test_unreachable_sidecar_is_one_line_naming_the_url() -> None:
    with socket.socket() as s:  # a free port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = stats("--url", f"http://127.0.0.1:{port}", "--once")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(
        f"hicache: error: cannot reach the sidecar at http://127.0.0.1:{port}/v1/stats: "
    )


def test_no_http_port_says_so(tmp_path: Path) -> None:
    config = write_config(tmp_path, http_port=None)
    result = stats("--config", str(config), "--once")
    assert result.returncode == 2
    assert "service.http_port is not set" in result.stderr


def test_stall_quantiles_interpolate_like_histogram_quantile() -> None:
    text = "\n".join(
        [
            "# TYPE hicache_layer_stall_seconds histogram",
            'hicache_layer_stall_seconds_bucket{le="0.001"} 50.0',
            'hicache_layer_stall_seconds_bucket{le="0.01"} 90.0',
            'hicache_layer_stall_seconds_bucket{le="+Inf"} 100.0',
        ]
    )
    samples = Metrics.parse(text).samples["hicache_layer_stall_seconds_bucket"]
    buckets = [(float(labels["le"]), value) for labels, value in samples]
    assert quantile(buckets, 0.5) == 0.001
    assert abs((quantile(buckets, 0.7) or 0) - 0.0055) < 1e-12
    assert quantile(buckets, 0.99) == 0.01  # in +Inf: the last finite bound
    assert quantile([(float("inf"), 0.0)], 0.5) is None
