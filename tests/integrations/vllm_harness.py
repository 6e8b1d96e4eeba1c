"""What the vLLM tests share: per-model prompts and expected hits, a sidecar deployment for a
model, engine runs in processes of their own (`vllm_driver.py`), and L3 corruption.

Each engine is a real vLLM (the CPU build) on a tiny random-weight model built at test time
(`vllm_models.py`); each sidecar is a real `hicache serve` with a file L3. The judge is vLLM
itself: with hicache hits, greedy tokens and their logprobs must equal a run of the same
prompts, in the same rounds, with no connector at all.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
    log = work / f"{name}.log"
    with log.open("w") as log_file, open(os.devnull) as nothing:
        proc = launch([str(plan_path), str(out_path)], nothing, log_file, log_file)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=60)
            raise
    if proc.returncode != 0:
        raise AssertionError(
            f"vLLM engine {name} exited {proc.returncode}; last log lines:\n"
            + "\n".join(log.read_text().splitlines()[-40:])
        )
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


class LaunchedProcess:
    """An engine process forked by the warm launcher (`vllm_zygote`), with the part of
    `subprocess.Popen`'s interface the harness uses: `pid`, `returncode`, `poll`, `wait`,
    `send_signal`, `kill`, and `stdin`/`stdout` where the caller gave it pipes."""

    def __init__(self, conn: socket.socket, pid: int):
        self._conn, self.pid = conn, pid
        self.returncode: int | None = None
        self.stdin: IO[str] | None = None
        self.stdout: IO[str] | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_exit(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._read_exit(timeout):
            raise subprocess.TimeoutExpired(f"vLLM engine pid {self.pid}", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read_exit(self, timeout: float | None) -> bool:
        with selectors.DefaultSelector() as selector:
            selector.register(self._conn, selectors.EVENT_READ)
            if not selector.select(timeout):
                return False
        message = self._conn.recv(256).decode()
        self._conn.close()
        if not message.startswith("exit "):
            raise AssertionError(f"the vLLM launcher lost engine pid {self.pid}: {message!r}")
        self.returncode = int(message.split()[1])
        return True


_launcher: tuple[subprocess.Popen[bytes], str] | None = None
_launcher_lock = threading.Lock()


def launch(argv: list[str], stdin: IO[str], stdout: IO[str], stderr: IO[str]) -> LaunchedProcess:
    """`python -m tests.integrations.vllm_driver ARGV` with these standard streams, forked
    by this process's warm launcher (started on first use, ended with this process)."""
    global _launcher
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with _launcher_lock:
        if _launcher is None or _launcher[0].poll() is not None:
            path = os.path.join(tempfile.mkdtemp(prefix="hicache-vllm-"), "launch.sock")
            log = open(path + ".log", "w")  # noqa: SIM115 (the launcher's, for its lifetime)
            zygote = subprocess.Popen(
                [sys.executable, "-m", "tests.integrations.vllm_zygote", path],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )
            assert zygote.stdout is not None
            if zygote.stdout.readline() != b"ready\n":
                zygote.wait(timeout=60)
                raise AssertionError(
                    f"the vLLM launcher exited {zygote.returncode}: {Path(path + '.log').read_text()}"
                )
            atexit.register(_stop_launcher, zygote, os.path.dirname(path))
            _launcher = (zygote, path)
        path = _launcher[1]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    request = {"argv": argv, "cwd": str(ROOT), "env": env}
    socket.send_fds(
        conn, [json.dumps(request).encode()], [f.fileno() for f in (stdin, stdout, stderr)]
    )
    reply = conn.recv(256).decode()
    if not reply.startswith("pid "):
        conn.close()
        raise AssertionError(f"the vLLM launcher refused {argv}: {reply!r}")
    return LaunchedProcess(conn, int(reply.split()[1]))


def _stop_launcher(zygote: subprocess.Popen[bytes], folder: str) -> None:
    if zygote.stdin is not None:
        zygote.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        zygote.wait(timeout=10)
    if zygote.returncode == 0:  # its folder (socket and log); kept to read if it failed
        shutil.rmtree(folder, ignore_errors=True)


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
        kv_role: str = "kv_both",
        kv_events: dict[str, Any] | None = None,
    ):
        """`kv_events`: vLLM's `KVEventsConfig` fields (endpoint, replay_endpoint, ...):
        the engine publishes its KV events on ZMQ."""
        work.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log = work / f"{name}.log"
        plan = {
            "model": str(model),
            "connector": connector,
            "max_model_len": max_model_len,
            "kv_role": kv_role,
            "kv_events": kv_events,
        }
        plan_path = work / f"{name}.plan.json"
        plan_path.write_text(json.dumps(plan))
        self._log: IO[str] = self.log.open("w")
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        with os.fdopen(stdin_r) as child_in, os.fdopen(stdout_w, "w") as child_out:
            self.proc = launch(["--serve", str(plan_path)], child_in, child_out, self._log)
        self.proc.stdin = os.fdopen(stdin_w, "w")
        self.proc.stdout = os.fdopen(stdout_r, "r")
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
