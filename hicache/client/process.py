"""`SidecarProcess`: run `hicache serve` as a child process (the demo, the tests, benchmarks).

Lifecycle: `start()` spawns `python -m hicache serve --config FILE` and waits for its `ready`
line (which carries the socket and the HTTP port) -> `get(path)` reads the HTTP API ->
`stop(signal)` sends SIGTERM (or another signal) and returns the exit code. Its log lines go
to a file beside the config (`log_path`), so a failure can be shown to the user.

It lives on the engine's side: it runs the sidecar through the `hicache` command, importing
nothing of `hicache.service` (stdlib only).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class SidecarStartError(RuntimeError):
    pass


class SidecarProcess:
    def __init__(
        self,
        config: Path,
        *,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        start_timeout_s: float = 60.0,
        new_session: bool = False,
        command: Sequence[str] | None = None,
    ):
        """`command`: the argv before `--config FILE` (default `python -m hicache serve`; a
        harness such as `hicache.testing.serve.command(faults)`), which must print the same
        `ready` line."""
        self.command = list(command or [sys.executable, "-m", "hicache", "serve"])
        self.config = config
        self.new_session = new_session  # a session leader, as under systemd or a container
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path or config.with_suffix(".serve.log")
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.ready: dict[str, str] = {}

    def start(self) -> SidecarProcess:
        log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [*self.command, "--config", str(self.config)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=self.env,
            start_new_session=self.new_session,
        )
        log.close()
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait()
                raise SidecarStartError(
                    f"hicache serve exited with {code} before it was ready; its log "
                    f"({self.log_path}):\n{self.log_path.read_text()[-4000:]}"
                )
            if line.startswith("hicache serve: ready"):
                self.ready = dict(part.split("=", 1) for part in line.split()[3:] if "=" in part)
                return self
        self.stop(signal.SIGKILL)
        raise SidecarStartError(f"hicache serve was not ready in {self.start_timeout_s} s")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def socket(self) -> str:
        return self.ready["socket"]

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.ready['http_port']}"

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.http + path, timeout=10) as reply:
                return int(reply.status), reply.read().decode()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read().decode()

    def get_json(self, path: str) -> Any:
        status, body = self.get(path)
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}: {body}")
        return json.loads(body)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code

    def __enter__(self) -> SidecarProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
