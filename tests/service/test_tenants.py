"""Fair shares of a shared L2 against a real `hicache serve`, with engine processes of two
tenants (`tenant_engine.py`): tenant A replays a working set smaller than its guaranteed
share while tenant B floods the L2 with cold prompts. With A's share, A keeps (nearly) the
hit rate it has alone and only B's pages are evicted; with the same L2 shared without shares,
the flood evicts A's pages and its hit rate collapses. Every loaded byte is verified. Plus the
start-up refusals of bad `tenants` sections (exit 2, one line naming file, key and value)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.cli.main import main
from hicache.cli.stats import render, snapshot
from hicache.client.process import SidecarProcess
from tests.conftest import REPO, shared_model

ROUNDS = 4  # replays of A's working set while B floods
WORKING_SET = 4  # A's prompts, 4 pages each: 16 of L2's 48 full-attention pages
FLOOD = 12  # B's cold prompts between two of A's replays: 48 pages, all of L2


def model_config(tmp_path: Path) -> Path:
    """LFM2-350M's config.json with a 256-token context, so a guaranteed share of a test-sized
    L2 holds one long prompt (`config.capacity`: min(max_position_embeddings, 32k) tokens)."""
    data = json.loads(shared_model("lfm2_350m.json").read_text())
    data["max_position_embeddings"] = 256  # 16 pages of 16 tokens
    path = tmp_path / "lfm2_256" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def write_config(tmp_path: Path, tenants: dict[str, Any], name: str = "deploy") -> Path:
    data = {
        "model": {"config_path": str(model_config(tmp_path)), "page_size_tokens": 16},
        "device": {"kind": "cpu"},
        # 3/4 for the full-attention group: 48 pages of 192 KiB; 1/4 for conv snapshots
        "host": {"capacity_bytes": "12MiB"},
        "storage": {"kind": "none"},  # L2 alone: an evicted page is a miss
        "service": {
            "socket_path": str(tmp_path / f"{name[:4]}.sock"),
            "http_port": 0,
            "heartbeat_timeout_s": 5,
        },
        "tenants": tenants,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class TenantEngine:
    """One tenant's engine process, one command at a time over stdin."""

    def __init__(self, config: Path, tenant: str, seed: int):
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.service.tenant_engine",
                "--config",
                str(config),
                "--tenant",
                tenant,
                "--seed",
                str(seed),
                "--prompts",
                str(WORKING_SET),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )

    def registered(self) -> None:
        assert self.read() == {"event": "registered"}

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"engine exited: {self.proc.stderr.read() if self.proc.stderr else ''}"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def quit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        _, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err


@contextlib.contextmanager
def running(config: Path) -> Iterator[SidecarProcess]:
    sidecar = SidecarProcess(config).start()
    try:
        yield sidecar
    finally:
        assert sidecar.stop() == 0, config.with_suffix(".serve.log").read_text()


def noisy_run(config: Path) -> tuple[float, float, dict[str, Any]]:
    """A's hit rate alone and while B floods (tokens loaded / tokens asked, over the replays
    after A stored its working set), and the sidecar's per-tenant stats at the end."""
    with running(config) as sidecar:
        a = TenantEngine(config, "a", seed=1)
        b = TenantEngine(config, "b", seed=2)
        try:
            a.registered()
            b.registered()
            a.ask("replay")  # stores the working set
            alone = [a.ask("replay") for _ in range(2)]
            flooded = []
            for _ in range(ROUNDS):
                b.ask(f"flood {FLOOD}")
                flooded.append(a.ask("replay"))
            stats = sidecar.get_json("/v1/stats")["tenants"]
            _, metrics = sidecar.get("/metrics")
            frame = render(snapshot(sidecar.http, None, 10.0))
            ready = sidecar.get_json("/readyz")
            namespaces = sidecar.get_json("/v1/stats")["namespaces"]
        finally:
            for engine in (a, b):
                with contextlib.suppress(Exception):
                    engine.quit()
                if engine.proc.poll() is None:
                    engine.proc.kill()
    assert all(r["mismatches"] == 0 for r in alone + flooded)
    # one L2 for both tenants: counted once
    l2_bytes = {sum(g["l2_bytes"] for g in ns["groups"].values()) for ns in namespaces}
    assert len(namespaces) == 2
    assert len(l2_bytes) == 1
    assert ready["host_pools_bytes"] == l2_bytes.pop()
    # the same figures in /metrics and `hicache stats`
    held = sum(g["held_pages"] for g in stats["b"]["l2"]["0"].values())
    assert 'hicache_tenant_l2_pages{group="full",tenant="b"} ' in metrics
    assert re.search(
        r'hicache_tenant_l2_evicted_pages_total\{by="self",group="full",tenant="b"\} [1-9]', metrics
    ), metrics
    assert re.search(rf"^  'b' \(rest\) +\S+ +[\d,]+ +{held:,} ", frame, re.M), frame

    def rate(replies: list[dict[str, Any]]) -> float:
        return sum(r["hit"] for r in replies) / sum(r["asked"] for r in replies)

    return rate(alone), rate(flooded), stats


def evicted(stats: dict[str, Any], tenant: str, key: str) -> int:
    return sum(g[key] for rank in stats[tenant]["l2"].values() for g in rank.values())


def test_a_guaranteed_share_keeps_a_tenants_hits_through_anothers_flood(tmp_path: Path) -> None:
    shared = write_config(tmp_path, {"shared_l2": True, "l2_shares": {"a": {"l2_share": 0.5}}})
    # the same L2 shared without shares: one least-recently-used order over both tenants
    off = write_config(tmp_path, {"shared_l2": True}, name="noshares")
    with ThreadPoolExecutor(2) as pool:  # two sidecars side by side: the run's wall time halved
        with_shares, without = pool.submit(noisy_run, shared), pool.submit(noisy_run, off)
        alone, flooded, stats = with_shares.result()
        alone_off, flooded_off, stats_off = without.result()
    print(
        f"A's hit rate: shares {alone} alone, {flooded} flooded; no shares {alone_off} "
        f"alone, {flooded_off} flooded"
    )
    assert alone == 1.0
    assert flooded >= 0.9 * alone, (alone, flooded)
    # B's pages are the ones evicted: none of A's, many of B's
    assert evicted(stats, "a", "evicted_pages") == 0, stats["a"]
    assert evicted(stats, "b", "evicted_pages") >= ROUNDS * FLOOD, stats["b"]
    assert stats["a"]["holder"] == "a"
    assert stats["b"]["holder"] == "*"
    assert stats["a"]["lookup_tokens"]["l2"] > 0

    # without shares the flood takes A's pages too
    assert alone_off == 1.0
    assert flooded_off <= 0.5 * alone_off, (alone_off, flooded_off)
    assert evicted(stats_off, "a", "evicted_by_others_pages") > 0, stats_off["a"]


@pytest.mark.parametrize(
    ("tenants", "match"),
    [
        (
            {"shared_l2": True, "l2_shares": {"a": {"l2_share": 0.7}, "b": {"l2_share": 0.4}}},
            r"tenants: the l2_share values add up to 1\.1 \('a' 0\.7, 'b' 0\.4\); allowed: "
            r"at most 1",
        ),
        (
            {"shared_l2": True, "l2_shares": {"a": {"l2_share": 0.2}}},
            r"tenants\.l2_shares\.a\.l2_share 0\.2 guarantees 9 of L2's 48 pages, smaller "
            r"than one long prompt \(16 pages, 256 tokens, the model's "
            r"max_position_embeddings\); allowed: at least 0\.334",
        ),
        (
            {"shared_l2": True, "l2_shares": {"a": {"l2_share": 0.5, "l2_quota": 0.6}}},
            r"tenants\.l2_shares\.a\.l2_quota: unknown key; allowed keys here: l2_cap, l2_share",
        ),
        (
            {"l2_shares": {"a": {"l2_share": 0.5}}},
            r"l2_shares lists \['a'\] but shared_l2 is false",
        ),
        (
            {"shared_l2": True, "l2_shares": {"a": {"l2_share": 0.5, "l2_cap": 0.4}}},
            r"l2_cap 0\.4 is below l2_share 0\.5",
        ),
        (
            {"shared_l2": True, "l2_shares": {"a": {"l2_share": 0.01}}},
            r"tenants\.l2_shares\.a\.l2_share 0\.01 guarantees no snapshot of state group "
            r"'conv' \(76 in L2\); allowed: at least 0\.014",
        ),
    ],
    ids=[
        "over-100%",
        "below-one-long-prompt",
        "unknown-key",
        "shares-unshared",
        "cap-below",
        "no-snapshot",
    ],
)
def test_bad_tenants_sections_are_refused(
    tmp_path: Path, tenants: dict[str, Any], match: str, capsys: Any
) -> None:
    """`hicache config validate` refuses each, naming the file, the key and the value."""
    config = write_config(tmp_path, tenants)
    assert main(["config", "validate", str(config)]) == 2
    err = capsys.readouterr().err
    assert str(config) in err
    assert re.search(match, err), err
    assert "Traceback" not in err


def test_a_share_below_one_long_prompt_stops_serve_at_start(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"shared_l2": True, "l2_shares": {"a": {"l2_share": 0.2}}})
    proc = subprocess.run(
        [sys.executable, "-m", "hicache", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.search(
        rf"{re.escape(str(config))}: tenants\.l2_shares\.a\.l2_share 0\.2 guarantees 9", lines[0]
    ), lines[0]
