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
    assert any(line.endswith("mismatches: 0") for line in result.stdout.splitlines())


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
    assert "groups: (bfloat16, 64-token pages; host.capacity_bytes 96GiB)" in deploy.stdout
    table = deploy.stdout.split("groups: ", 1)[1].splitlines()
    assert table[1].split() == (
        [
            "group",
            "kind",
            "layers",
            "page",
            "bytes",
            "per",
            "GiB",
            "of",
            "L2",
            "L2",
            "holds",
            "geometry",
        ]
    )
    linear = next(line for line in table if line.split()[0] == "linear")
    full = next(line for line in table if line.split()[0] == "full")
    # one rank's share at the deployment's tp_size 4: a quarter of the linear heads, one of
    # the two KV heads (a 27-snapshot, 43,648-token GiB at tp_size 1)
    assert "108 snapshots" in linear
    assert "2,608 snapshots" in linear
    assert "87,360 tokens" in full
    assert "6,291,456 tokens" in full
    single = hicache("layout", str(CONFIGS / "qwen3-next-80b.yaml"), "--tp-size", "1")
    assert single.returncode == 0, single.stderr
    assert "27 snapshots" in single.stdout
    assert "43,648 tokens" in single.stdout


def test_layout_groups_table_page_bytes_and_stage_range() -> None:
    """The groups as a table (page bytes, tokens or snapshots per GiB; no Python reprs) and
    the stage in the flags' convention: --start-layer inclusive, --end-layer exclusive."""
    result = hicache("layout", str(CONFIGS / "models" / "gpt-oss-20b.json"), "--end-layer", "6")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.splitlines()[0].endswith("stage: layers 0..5 (end exclusive: 6)")
    assert "{" not in out
    assert "[" not in out
    assert "groups: (bfloat16, 16-token pages)" in out
    sliding = next(line for line in out.splitlines() if line.startswith("  sliding "))
    # the stage's 3 sliding layers: 3 x 16 tokens x K+V x 8 heads x 64 x 2 bytes = 96 KiB
    assert sliding.split()[:6] == ["sliding", "sliding", "3", "96", "KiB", "174,752"]
    assert "window_tokens=128" in sliding
    assert "full_attention_layer_ids: 1, 3, 5" in out


def group_json(*args: str) -> dict[str, dict[str, object]]:
    result = hicache("layout", *args, "--json")
    assert result.returncode == 0, result.stderr
    return {g["name"]: g for g in json.loads(result.stdout)["groups"]}


def test_layout_page_size_and_dtype_flags(tmp_path: Path) -> None:
    model = str(shared_model("qwen3_next_80b.json"))
    base = group_json(model)
    assert base["full"]["page_bytes"] == 12 * 16 * 2 * 2 * 256 * 2  # layers, tokens, K+V, heads
    assert base["full"]["page_size_tokens"] == 16
    assert base["full"]["tokens_per_gib"] == 2**30 // base["full"]["page_bytes"] * 16
    assert base["full"]["snapshots_per_gib"] is None
    assert base["linear"]["tokens_per_gib"] is None
    assert base["linear"]["snapshots_per_gib"] == 2**30 // base["linear"]["page_bytes"]
    assert {"name", "kind", "layer_ids", "kv_heads"} <= set(base["full"])  # the old keys stay
    bigger = group_json(model, "--page-size", "32", "--dtype", "float32")
    assert bigger["full"]["page_bytes"] == 4 * base["full"]["page_bytes"]
    assert bigger["linear"]["page_bytes"] == 2 * base["linear"]["page_bytes"]  # no tokens
    # a config.json's torch_dtype is the default dtype
    data = json.loads(Path(model).read_text())
    data["torch_dtype"] = "float32"
    f32 = tmp_path / "config.json"
    f32.write_text(json.dumps(data))
    assert group_json(str(f32))["full"]["page_bytes"] == 2 * base["full"]["page_bytes"]
    bad = hicache("layout", model, "--page-size", "0")
    assert bad.returncode == 2
    assert bad.stderr == "hicache: error: --page-size 0: allowed: a positive token count\n"


def test_version() -> None:
    import tomllib

    import hicache as package

    result = hicache("--version")
    assert result.returncode == 0
    assert result.stdout == f"hicache {package.__version__}\n"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert package.__version__ == project["version"]


def test_every_command_and_flag_has_help() -> None:
    import argparse

    from hicache.cli.main import _parser

    missing: list[str] = []

    def walk(parser: argparse.ArgumentParser, where: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help for a in action._choices_actions}
                for name, sub in action.choices.items():
                    if not helps.get(name):
                        missing.append(f"{where} {name}")
                    walk(sub, f"{where} {name}")
            elif not action.help:
                missing.append(f"{where} {'/'.join(action.option_strings) or action.dest}")

    walk(_parser(), "hicache")
    assert missing == []


def test_a_command_without_its_subcommand_prints_its_help() -> None:
    result = hicache("config")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("usage: hicache config ")
    assert "validate" in result.stderr
    assert "reference" in result.stderr
    last = result.stderr.splitlines()[-1]
    assert last == "hicache config: error: name a subcommand (validate, show, schema, reference)"
    bare = hicache()
    assert bare.returncode == 2
    assert bare.stderr.splitlines()[-1].startswith("hicache: error: name a command (")


def test_a_closed_stdout_ends_quietly() -> None:
    """`hicache ... | head -1`: the reader is gone before (or while) the command writes; no
    BrokenPipeError traceback, a quiet exit."""
    import os

    for args in (
        ("config", "show", str(CONFIGS / "default.yaml"), "--json"),
        ("config", "schema"),
        ("layout", str(shared_model("gemma3n_e4b.json")), "--json"),
        ("--help",),
    ):
        read, write = os.pipe()
        os.close(read)  # the reader went away first: every write gets EPIPE
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "hicache", *args],
                stdout=write,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
                timeout=60,
            )
        finally:
            os.close(write)
        assert proc.stderr == "", (args, proc.stderr)
        assert proc.returncode in (0, 141), (args, proc.returncode)
