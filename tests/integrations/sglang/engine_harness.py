"""SGLang engines (and other SGLang drivers) in processes of their own, for tests in the main
environment.

    python = require_sglang()                      # skip (or fail under CI) without SGLang
    model = tiny_model(python, tmp / "qwen2")      # a random-weight model, built once
    with SglangEngine(tmp / "a", model, engine_args={...}) as engine:
        engine.ready()                             # waits for the engine (12-46 s on 2 cores)
        [r] = engine.generate([prompt])            # r["output"], r["cached"], r["prompt_tokens"]
        engine.flush_cache()

Each engine is `engine_driver.py` in the SGLang environment (`sglang_env`), long-lived and
driven over stdin, so a module shares its engines across tests (module-scoped fixtures): start
costs dominate. `send_generate` / `results` split a round so a test can act meanwhile; `kill`
ends the process at once (SIGKILL to its process group: SGLang's scheduler and detokenizer are
children of the driver). `pause_env(...)` (passed as `env=`) stops one function in every
process of the engine forever once `arm()`ed, announcing it (`paused()`), so a test can kill
the engine in the middle of it. `DriverProcess` is the same pipe for any driver module of this
folder (`controller_driver.py`). Logs: `<work>/<name>.log`.

Lifecycle of a driver process: starting -> ready (its first line) -> serving (a reply per
command) -> stopped (`close()`: EOF on stdin, then killed if it has not ended in time) or
killed (`kill()`). A reply that does not come in time, an error reply or an early exit raises
`EngineError` with the log's last lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from tests.integrations.sglang.sglang_env import ROOT, require_sglang, sglang_environ

__all__ = ["DriverProcess", "EngineError", "SglangEngine", "require_sglang", "tiny_model"]


def tiny_model(python: Path, out: Path, kind: str = "qwen2") -> Path:
    """The tiny model `kind` (`models.RECIPES`) in `out`, built by the SGLang python."""
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [str(python), "-m", "tests.integrations.sglang.models", kind, str(out)],
        cwd=ROOT,
        env=sglang_environ(cpu_shims=False),
        check=True,
        timeout=600,
    )
    return out


class EngineError(AssertionError):
    """The driver process failed or answered an error; carries its log's last lines."""


class DriverProcess:
    """A driver module run by the SGLang python in a process (and process group) of its own;
    see the module doc."""

    def __init__(
        self,
        module: str,
        args: list[str],
        work: Path,
        name: str,
        *,
        env: dict[str, str] | None = None,
        python: Path | None = None,
    ):
        work.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.work = work
        self.log = work / f"{name}.log"
        self._log_file: IO[str] = self.log.open("w")
        self.proc = subprocess.Popen(
            [str(python or require_sglang()), "-m", module, *args],
            cwd=ROOT,
            env=sglang_environ(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            start_new_session=True,  # one process group: kill() takes its children too
        )
        self.start_s: float | None = None

    def ready(self, timeout_s: float = 600) -> Self:
        """Wait until the driver is up; its start time is `start_s`."""
        if self.start_s is None:
            self.start_s = float(self._reply(timeout_s)["ready"])
        return self

    def request(self, command: dict[str, Any], timeout_s: float = 300) -> dict[str, Any]:
        """One command and its reply."""
        self.ready()
        self._send(command)
        return self._reply(timeout_s)

    def kill(self) -> None:
        """SIGKILL the driver and its children (no shutdown)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)

    def close(self, timeout_s: float = 120) -> None:
        """EOF on stdin (the driver shuts down); killed when it has not ended in time."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout_s)
        self.kill()  # what is left of its process group (SGLang's children may outlive it)
        self._log_file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._failed("its stdin closed (the process ended)") from None

    def _reply(self, timeout_s: float = 300) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while not selector.select(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
                if self.proc.poll() is not None:
                    break
                if time.monotonic() > deadline:
                    raise self._failed(f"no reply within {timeout_s:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise self._failed(f"it exited ({self.proc.poll()}) without a reply")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise self._failed(f"it answered {reply['error']}")
        return reply

    def _failed(self, what: str) -> EngineError:
        self._log_file.flush()
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
        return EngineError(f"SGLang process {self.name}: {what}; last log lines:\n{tail}")


class SglangEngine(DriverProcess):
    """One `sglang.Engine` (tiny model, CPU) in a process of its own; see the module doc."""

    def __init__(
        self,
        work: Path,
        model: Path,
        *,
        engine_args: dict[str, Any] | None = None,
        name: str = "engine",
        env: dict[str, str] | None = None,
        python: Path | None = None,
    ):
        work.mkdir(parents=True, exist_ok=True)
        self.arm_path = work / f"{name}.pause-armed"
        self.announce_path = work / f"{name}.paused"
        plan_path = work / f"{name}.plan.json"
        plan_path.write_text(json.dumps({"model": str(model), "engine_args": engine_args or {}}))
        super().__init__(
            "tests.integrations.sglang.engine_driver",
            [str(plan_path)],
            work,
            name,
            env=env,
            python=python,
        )

    @staticmethod
    def pause_env(spec: str, work: Path, name: str = "engine") -> dict[str, str]:
        """The `env=` that makes `spec` ("module:Class.method") stop forever, in every
        process of engine `name` in `work`, once `arm()` is called; `paused()` says when."""
        return {
            "_HICACHE_SGLANG_PAUSE_IN": spec,
            "_HICACHE_SGLANG_PAUSE_ARM": str(work / f"{name}.pause-armed"),
            "_HICACHE_SGLANG_PAUSE_ANNOUNCE": str(work / f"{name}.paused"),
        }

    def arm(self) -> None:
        self.arm_path.write_text("armed")

    def paused(self) -> bool:
        return self.announce_path.exists()

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 8) -> list[dict[str, Any]]:
        """Greedy generation of each prompt in turn: output ids, `cached` (SGLang's
        cached_tokens) and `prompt_tokens` per prompt."""
        self.send_generate(prompts, max_new_tokens)
        return self.results()

    def send_generate(self, prompts: list[list[int]], max_new_tokens: int = 8) -> None:
        self.ready()
        self._send({"generate": prompts, "max_new_tokens": max_new_tokens})

    def results(self, timeout_s: float = 300) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = self._reply(timeout_s)["results"]
        return results

    def flush_cache(self) -> bool:
        return bool(self.request({"flush_cache": True})["flushed"])
