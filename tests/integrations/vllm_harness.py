"""What the vLLM tests share: per-model prompts and expected hits, a sidecar deployment for a
model, engine runs in processes of their own (`vllm_driver.py`), and L3 corruption.

Each engine is a real vLLM (the CPU build) on a tiny random-weight model built at test time
(`vllm_models.py`); each sidecar is a real `hicache serve` with a file L3. The judge is vLLM
itself: with hicache hits, greedy tokens and their logprobs must equal a run of the same
prompts, in the same rounds, with no connector at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]

# vLLM's block per model (a hicache page): Qwen3-Next's attention block grows to its state page
PAGE = {"llama": 128, "gemma3": 128, "gpt_oss": 128, "qwen3_next": 384, "lfm2": 128}
# Qwen3-Next's recurrent state in fp32: the driver pins vLLM's `mamba_ssm_cache_dtype` to it
# (`vllm_driver.VLLM_ARGS`; unpinned, vLLM's CPU build picks it by CPU)
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


class EngineProcess:
    """A long-lived vLLM engine in a process of its own (`vllm_driver --serve`): started once,
    then driven round by round (each round one `generate` after vLLM's own prefix cache is
    reset, as `run_engine`'s rounds). Its log is `<work>/<name>.log`."""

    def __init__(
        self,
        work: Path,
        model: Path,
        *,
        connector: dict[str, Any] | None = None,
        name: str = "engine",
        max_model_len: int = 2048,
    ):
        work.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log = work / f"{name}.log"
        plan = {"model": str(model), "connector": connector, "max_model_len": max_model_len}
        plan_path = work / f"{name}.plan.json"
        plan_path.write_text(json.dumps(plan))
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self._log: IO[str] = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integrations.vllm_driver", "--serve", str(plan_path)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.start_s: float | None = None

    def ready(self, timeout_s: float = 900) -> EngineProcess:
        """Wait until the engine is up (its first line)."""
        if self.start_s is None:
            self.start_s = float(self._reply(timeout_s)["ready"])
        return self

    def round(self, prompts: list[list[int]], max_tokens: int = 8) -> list[dict[str, Any]]:
        """One round's results: per prompt its tokens, logprobs and `cached` tokens."""
        self.ready()
        self._send({"prompts": prompts, "max_tokens": max_tokens})
        results: list[dict[str, Any]] = self._reply()["results"]
        return results

    def pause_in_loads(self, announce: Path) -> None:
        """From now on the engine stops forever inside its next load (announcing it)."""
        self.ready()
        self._send({"pause_in_loads": str(announce)})
        self._reply()

    def send_round(self, prompts: list[list[int]], max_tokens: int = 8) -> None:
        """Start a round without waiting for it: `results()` reads it (unless the engine is
        killed during it)."""
        self.ready()
        self._send({"prompts": prompts, "max_tokens": max_tokens})

    def results(self) -> list[dict[str, Any]]:
        """The results of the round `send_round` started."""
        results: list[dict[str, Any]] = self._reply()["results"]
        return results

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)
        self._log.close()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=120)
        self.kill()

    def _send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def _reply(self, timeout_s: float = 900) -> dict[str, Any]:
        """The next line the engine writes; its death or silence for `timeout_s` (a deadline
        for a machine under load, not a measurement) fails with its log's tail."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while not selector.select(timeout=1.0):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    break
        line = self.proc.stdout.readline() if self.proc.poll() is None else ""
        if not line:
            self._log.flush()
            tail = "\n".join(self.log.read_text().splitlines()[-40:])
            state = "exited" if self.proc.poll() is not None else f"silent for {timeout_s:g} s"
            raise AssertionError(f"vLLM engine {self.name} {state}; last log lines:\n{tail}")
        reply: dict[str, Any] = json.loads(line)
        return reply
