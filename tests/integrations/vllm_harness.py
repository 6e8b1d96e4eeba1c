"""What the vLLM tests share: per-model prompts and expected hits, a sidecar deployment for a
model, engine runs in processes of their own (`vllm_driver.py`), and L3 corruption.

Each engine is a real vLLM (the CPU build) on a tiny random-weight model built at test time
(`vllm_models.py`); each sidecar is a real `hicache serve` with a file L3. The judge is vLLM
itself: with hicache hits, greedy tokens and their logprobs must equal a run of the same
prompts, in the same rounds, with no connector at all.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# vLLM's block per model (a hicache page): Qwen3-Next's attention block grows to its state page
PAGE = {"llama": 128, "gemma3": 128, "gpt_oss": 128, "qwen3_next": 384, "lfm2": 128}
# vLLM keeps Qwen3-Next's recurrent state in fp32 (its CPU GDN backend resets it)
SSM_DTYPE = {"qwen3_next": "float32"}


@dataclass(frozen=True)
class Prompts:
    """A: three pages and a tail; B: A's three pages and part of its tail, then tokens of
    its own; C: unrelated. B shares all of A's full pages because a state model resumes only
    where a snapshot was kept: vLLM's "align" prefill of A stops at its last page boundary
    (3 pages) and nowhere before, so that is the only snapshot of A there is."""

    page: int
    a: list[int]
    b: list[int]
    c: list[int]  # unrelated to A and B

    @classmethod
    def of(cls, kind: str, seed: int = 1) -> Prompts:
        page = PAGE[kind]
        rng = random.Random(seed)
        a = [rng.randrange(3, 500) for _ in range(3 * page + 50)]
        b = a[: 3 * page + 10] + [rng.randrange(3, 500) for _ in range(80)]
        c = [rng.randrange(3, 500) for _ in range(3 * page + 20)]
        return cls(page, a, b, c)

    def hit(self, prompt: list[int]) -> int:
        """The most hicache may serve of a prompt whose pages it holds: whole pages of all
        but the last token (vLLM computes that one)."""
        return (len(prompt) - 1) // self.page * self.page


def write_deployment(
    directory: Path, model: Path, kind: str, *, name: str | None = None, tp_size: int = 1
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = [
        "model:",
        f"  config_path: {model / 'config.json'}",
        "  dtype: bfloat16",
        f"  page_size_tokens: {PAGE[kind]}",
        f"  tp_size: {tp_size}",
    ]
    if kind in SSM_DTYPE:
        lines.append(f"  ssm_state_dtype: {SSM_DTYPE[kind]}")
    if name is not None:
        lines.append(f"  name: {name}")
    lines += [
        "device:",
        "  kind: cpu",
        "  pool_capacity_bytes: 16MiB",
        "host:",
        "  capacity_bytes: 256MiB",
        "storage:",
        "  kind: file",
        "  path: l3",
        "  capacity_bytes: 1GiB",
        "service:",
        "  socket_path: engine.sock",
        "  http_host: 127.0.0.1",
        "  http_port: 0",
        "  heartbeat_timeout_s: 10",
    ]
    path = directory / "deploy.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_engine(
    work: Path,
    model: Path,
    rounds: list[list[list[int]]],
    *,
    connector: dict[str, Any] | None = None,
    multiprocess: bool = False,
    between_rounds: dict[str, Any] | None = None,
    max_tokens: int = 8,
    name: str = "engine",
    timeout_s: float = 400,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """One vLLM engine instance in its own process: each round one generate() call, vLLM's own
    prefix cache reset before every round after the first."""
    work.mkdir(parents=True, exist_ok=True)
    plan = {
        "model": str(model),
        "connector": connector,
        "rounds": rounds,
        "multiprocess": multiprocess,
        "max_model_len": 2048,
        "max_tokens": max_tokens,
        "between_rounds": between_rounds or {},
        "tensor_parallel_size": tensor_parallel_size,
    }
    plan_path, out_path = work / f"{name}.plan.json", work / f"{name}.out.json"
    plan_path.write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integrations.vllm_driver", str(plan_path), str(out_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    (work / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(
            f"vLLM engine {name} exited {proc.returncode}; last log lines:\n"
            + "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        )
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def outputs(result: dict[str, Any]) -> list[list[tuple[list[int], list[float]]]]:
    return [[(r["output"], r["logprobs"]) for r in rnd] for rnd in result["rounds"]]


def cached(result: dict[str, Any]) -> list[list[int]]:
    return [[r["cached"] for r in rnd] for rnd in result["rounds"]]


def corrupt_l3(l3: Path) -> int:
    """Flip bytes in the payload of every object of a file L3; returns how many."""
    count = 0
    for path in sorted(l3.rglob("*.kv")):
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
        path.write_bytes(bytes(data))
        count += 1
    return count


def served_loads(stats: dict[str, Any]) -> int:
    """Loads a sidecar's namespaces completed (its `/v1/stats`)."""
    return sum(int(ns["load"]["ops"]) for ns in stats["namespaces"])
