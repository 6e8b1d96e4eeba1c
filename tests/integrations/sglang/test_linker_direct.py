"""`HicacheLinker` driven directly on SGLang's real `MHATokenToKVPool` (CPU) against a real
`hicache serve` (`linker_probe.py`, in the SGLang environment): a tail starting mid-prompt
hits and loads byte-exact layer by layer; a hit shorter than asked is refused once
what did hit has landed (SGLang then recomputes); a queued load cancels; with the sidecar
stopped every call answers "no hit / not stored" and none raises.

With an SWA component (`linker_swa_probe.py`): SGLang's real `SWAKVPool` of a tiny gpt-oss
against a sidecar of that model: both pools offloaded, looked up with SGLang's trailing-window
rule (a window missing a page restores nothing, a pool not moved answers no hit), loaded
byte-exact through the layer counter, the window alone too; a short window refused; a queued
load of both pools cancelled.

With a MAMBA component (`linker_mamba_probe.py`): SGLang's real `MambaPool` and
`HybridLinearKVPool` of a tiny Qwen3-Next against a sidecar of that model: the linker's counter
registered with `req_to_token_pool`, states stored after 4 and 6 pages answer [4, 6] (a missing
state removes its length), KV and state loaded byte-exact through the counter, the state alone
too; a load whose state was never stored refused."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from hicache.client.process import SidecarProcess
from tests.integrations.sglang.engine_harness import require_sglang, tiny_model
from tests.integrations.sglang.hybrid_harness import write_hybrid_deployment
from tests.integrations.sglang.sglang_env import ROOT, sglang_environ


def test_the_linker_on_sglangs_pool_against_a_real_sidecar(tmp_path: Path) -> None:
    python = require_sglang()
    model = tiny_model(python, tmp_path / "qwen2")
    data = {
        "model": {
            "config_path": str(model / "config.json"),
            "dtype": "bfloat16",
            "page_size_tokens": 16,
        },
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": "16MiB"},
        "storage": {"kind": "none"},
        "service": {"socket_path": str(tmp_path / "engine.sock"), "http_port": None},
    }
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(yaml.safe_dump(data))
    sidecar = SidecarProcess(deploy).start()
    probe = subprocess.Popen(
        [str(python), "-m", "tests.integrations.sglang.linker_probe", str(deploy), str(model)],
        cwd=ROOT,
        env=sglang_environ(cpu_shims=False),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "probe.log").open("w"),
        text=True,
    )
    try:
        assert probe.stdout is not None
        assert probe.stdin is not None
        line = probe.stdout.readline()
        assert line.strip() == "stop-sidecar", (tmp_path / "probe.log").read_text()[-3000:]
        sidecar.stop()
        probe.stdin.write("stopped\n")
        probe.stdin.flush()
        result = yaml.safe_load(probe.stdout.readline())
        assert probe.wait(timeout=120) == 0
    finally:
        if probe.poll() is None:
            probe.kill()
        sidecar.stop()
    assert result == {
        "rebacked_or_shared": "Tensor",
        "offload_queued": True,
        "offloads_completed": [True],
        "lookup_whole": [1, 2, 3, 4],
        "lookup_tail": [1, 2, 3],
        "lookup_cold": [],
        "load_queued": True,
        "load_landed": True,
        "bytes_equal": True,
        "partial_load_queued": False,
        "no_batch_after_refusal": -1,
        "cancel_queued": True,
        "cancelled": True,
        "no_batch_after_cancel": -1,
        "down_lookup": [],
        "down_load": False,
        "down_offload": True,
        "down_offload_completed": [False],
    }, (tmp_path / "probe.log").read_text()[-3000:]


def run_probe(tmp_path: Path, model: str, probe: str) -> dict[str, Any]:
    """A probe module run in the SGLang environment against a real sidecar of `model`
    (`write_hybrid_deployment`: the model's config.json beside the deployment): its one
    JSON line."""
    python = require_sglang()
    deploy = write_hybrid_deployment(tmp_path, model)
    log = tmp_path / "probe.log"
    with SidecarProcess(deploy):
        run = subprocess.run(
            [str(python), "-m", f"tests.integrations.sglang.{probe}", str(deploy), str(tmp_path)],
            cwd=ROOT,
            env=sglang_environ(cpu_shims=False),
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            timeout=300,
            check=False,
        )
    assert run.returncode == 0, log.read_text()[-3000:]
    result: dict[str, Any] = yaml.safe_load(run.stdout.splitlines()[-1])
    result["log"] = log.read_text()[-3000:]
    return result


def test_the_linker_moves_an_swa_pool_against_a_real_sidecar(tmp_path: Path) -> None:
    result = run_probe(tmp_path, "gpt_oss", "linker_swa_probe")
    log = result.pop("log")
    assert result == {
        "pools": ["kv", "swa"],
        "offload_queued": True,
        "offloads_completed": [True],
        "lookup_whole": [6],
        "lookup_longer": [6],
        "lookup_window_short": [],
        "lookup_unmoved_pool": [],
        "load_queued": True,
        "load_landed": True,
        "full_bytes_equal": True,
        "swa_bytes_equal": True,
        "window_only_queued": True,
        "window_only_landed": True,
        "window_only_bytes_equal": True,
        "short_window_queued": False,
        "no_batch_after_refusal": -1,
        "cancel_queued": True,
        "cancelled": True,
        "no_batch_after_cancel": -1,
    }, log


def test_the_linker_moves_a_mamba_pool_against_a_real_sidecar(tmp_path: Path) -> None:
    result = run_probe(tmp_path, "qwen3_next", "linker_mamba_probe")
    log = result.pop("log")
    assert result == {
        "pools": ["kv", "mamba"],
        "counter_registered": True,
        "offloads_queued": [True, True],
        "offloads_completed": [True, True],
        "lookup_whole": [4, 6],
        "lookup_longer": [4, 6],
        "lookup_no_state_at_end": [4],
        "load_queued": True,
        "load_landed": True,
        "kv_bytes_equal": True,
        "state_bytes_equal": True,
        "state_only_queued": True,
        "state_only_landed": True,
        "state_only_bytes_equal": True,
        "missing_state_queued": False,
        "no_batch_after_refusal": -1,
    }, log
