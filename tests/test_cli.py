"""The command line, run as a real process: the layout JSON contract, config commands, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import CONFIGS, REPO, shared_model


def hicache(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicache", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )


def test_layout_json_contract() -> None:
    result = hicache("layout", str(shared_model("gemma3n_e4b.json")), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["model_type"] == "gemma3n"
    assert data["num_layers"] == 35
    assert data["full_attention_layer_ids"] == [4, 9, 14, 19]
    first, shared = data["layers"][0], data["layers"][24]
    assert first["id"] == 0
    assert first["kinds"] == ["sliding"]
    assert (first["group"], first["local_id"], first["reuses"]) == ("sliding", 0, None)
    assert shared == {**shared, "kinds": [], "group": None, "local_id": None, "reuses": 19}
    for row in data["layers"]:
        assert {"id", "kinds", "group", "local_id", "reuses"} <= set(row)


def test_layout_json_parallel_hybrid_and_stage() -> None:
    result = hicache(
        "layout",
        str(shared_model("falcon_h1_7b.json")),
        "--json",
        "--start-layer",
        "10",
        "--end-layer",
        "20",
    )
    data = json.loads(result.stdout)
    assert [row["id"] for row in data["layers"]] == list(range(10, 20))
    row = data["layers"][0]
    assert row["kinds"] == ["full", "mamba"]
    assert row["group"] == "full"
    assert row["local_id"] == 0
    assert row["groups"] == [{"group": "full", "local_id": 0}, {"group": "mamba", "local_id": 0}]


def test_layout_table_has_pattern_line() -> None:
    result = hicache("layout", str(shared_model("gemma3_27b.json")))
    assert result.returncode == 0
    assert "pattern: (S×5 F)×10 S×2" in result.stdout


def test_config_commands() -> None:
    ok = hicache("config", "validate", str(CONFIGS / "default.yaml"))
    assert ok.returncode == 0
    assert ok.stdout.endswith("ok (gpt_oss, 24 layers, 2 cache groups)\n")
    show = hicache(
        "config",
        "show",
        str(CONFIGS / "default.yaml"),
        "--json",
        env={"HICACHE_SCHEDULER__QUEUE_DEPTH": "8", "PATH": "/usr/bin:/bin"},
    )
    rows = {r["key"]: r for r in json.loads(show.stdout)}
    assert rows["scheduler.queue_depth"] == {
        "key": "scheduler.queue_depth",
        "value": 8,
        "source": "environment",
    }
    assert rows["host.capacity_bytes"]["source"] == "file"
    schema = json.loads(hicache("config", "schema").stdout)
    assert "model" in schema["properties"]


def test_errors_exit_2_with_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  config_path: nope.json\nhost:\n  layout: diagonal\n")
    result = hicache("config", "validate", str(bad))
    assert result.returncode == 2
    assert result.stderr.startswith(f"hicache: error: {bad}: host.layout: Input should be ")
    missing = hicache("layout", "/does/not/exist.json")
    assert missing.returncode == 2
    assert "cannot read model config '/does/not/exist.json'" in missing.stderr


def test_a_binary_layout_file_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    for name, expected in (
        ("bin.json", "is not UTF-8 text (byte 0xff at offset 0); allowed: a config.json"),
        ("bin.yaml", "cannot read layer list"),
    ):
        path = tmp_path / name
        path.write_bytes(b"\xff\xfe\x00garbage")
        result = hicache("layout", str(path))
        assert result.returncode == 2, result
        assert "Traceback" not in result.stderr
        assert result.stderr.count("\n") == 1
        assert result.stderr.startswith("hicache: error: ")
        assert expected in result.stderr


def test_demo_prints_layout_config_and_summary() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hicache", "demo", "--conversations", "4", "--turns", "2"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "pattern: (S F)×12" in result.stdout
    assert "host.capacity_bytes" in result.stdout
    assert "hit rate L1 / L2 / L3" in result.stdout
    assert result.stdout.rstrip().endswith("mismatches: 0")


def test_layout_says_what_l2_holds_per_group() -> None:
    """Sizing needs bytes per page and what a GiB holds: tokens for KV groups, snapshots for
    state groups; for a deployment, how its host.capacity_bytes splits between them."""
    bare = hicache("layout", str(shared_model("qwen3_next_80b.json")), "--json")
    assert bare.returncode == 0, bare.stderr
    rows = json.loads(bare.stdout)["sizing"]
    assert rows["full"]["unit"] == "tokens"
    assert rows["linear"]["unit"] == "snapshots"
    assert rows["full"]["per_gib"] == 2**30 // rows["full"]["bytes_per_page"] * 16
    assert rows["linear"]["per_gib"] == 2**30 // rows["linear"]["bytes_per_page"]
    deploy = hicache("layout", str(CONFIGS / "qwen3-next-80b.yaml"))
    assert deploy.returncode == 0, deploy.stderr
    assert "sizing: (host.capacity_bytes 96GiB)" in deploy.stdout
    assert "snapshots per GiB of L2; L2 holds 652 snapshots" in deploy.stdout
    assert "tokens per GiB of L2; L2 holds 3,145,728 tokens" in deploy.stdout
