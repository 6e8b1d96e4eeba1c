"""Real L3 servers on loopback for integration tests and benchmarks: Debian's redis-server
and the mooncake wheel's mooncake_master, each started on free ports and stopped by pid.
Never bound beyond 127.0.0.1."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_binary(name: str) -> str | None:
    beside_python = Path(sys.executable).parent / name  # console scripts of installed wheels
    if beside_python.exists():
        return str(beside_python)
    return shutil.which(name)


class _Server:
    binary_name = ""

    def __init__(self) -> None:
        binary = find_binary(self.binary_name)
        if binary is None:
            raise FileNotFoundError(f"{self.binary_name} is not installed")
        self.binary = binary
        self.process: subprocess.Popen[bytes] | None = None

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout_s: float = 15.0) -> None:
        self.process = subprocess.Popen(
            self._command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._ready():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.binary_name} did not come up within {timeout_s}s")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


class RedisServer(_Server):
    binary_name = "redis-server"

    def __init__(self, workdir: Path):
        super().__init__()
        self.port = free_port()
        self.workdir = workdir

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _command(self) -> list[str]:
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
        ]

    def _ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False


class MooncakeMaster(_Server):
    binary_name = "mooncake_master"

    def __init__(self) -> None:
        super().__init__()
        self.rpc_port = free_port()
        self.metrics_port = free_port()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def _command(self) -> list[str]:
        return [
            self.binary,
            "-rpc_address",
            "127.0.0.1",
            "-rpc_port",
            str(self.rpc_port),
            "-metrics_port",
            str(self.metrics_port),
            "-enable_metric_reporting=false",
        ]

    def _ready(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.2).close()
            return True
        except OSError:
            return False
