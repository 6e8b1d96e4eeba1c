"""Real L3 servers on loopback for integration tests and benchmarks: Debian's redis-server
and the mooncake wheel's mooncake_master, each started on free ports and stopped by pid.
Bound to 127.0.0.1 unless told another address (`MooncakeMaster(host=...)`, with a
`command_prefix` such as `("ip", "netns", "exec", NS)` to run it in a test host's network
namespace, `hicache.storage.netns_hosts`); readiness is then probed through the same prefix."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tcp_listening(host: str, port: int, command_prefix: Sequence[str] = ()) -> bool:
    """Whether something accepts TCP connections at host:port, seen from this process's
    network namespace, or (with a command prefix) from the one the prefix runs commands in."""
    if not command_prefix:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return True
        except OSError:
            return False
    probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=0.2).close()"
    done = subprocess.run(
        [*command_prefix, sys.executable, "-c", probe], capture_output=True, timeout=10
    )
    return done.returncode == 0


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

    def __init__(self, *, host: str = "127.0.0.1", command_prefix: Sequence[str] = ()) -> None:
        """`host`: the address its RPC and metrics ports bind to; `command_prefix`: what the
        command runs under (e.g. `ip netns exec NS`), readiness probed the same way."""
        super().__init__()
        self.host = host
        self.command_prefix = tuple(command_prefix)
        self.rpc_port = free_port()
        self.metrics_port = free_port()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def _command(self) -> list[str]:
        return [
            *self.command_prefix,
            self.binary,
            "-rpc_address",
            self.host,
            "-rpc_port",
            str(self.rpc_port),
            "-metrics_host",
            self.host,
            "-metrics_port",
            str(self.metrics_port),
            "-enable_metric_reporting=false",
        ]

    def _ready(self) -> bool:
        return tcp_listening(self.host, self.rpc_port, self.command_prefix)
