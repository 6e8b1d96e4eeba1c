"""Real L3 servers on loopback for integration tests and benchmarks: Debian's redis-server
(alone, or several as a Redis Cluster), the mooncake wheel's mooncake_master and its
mooncake_client (a process that only holds a segment of memory for the store), each started
on free ports and stopped by pid. Bound to 127.0.0.1 unless a caller names another host (the
cluster's and `MooncakeMaster`'s `host`, with a `command_prefix` such as
`("ip", "netns", "exec", NS)` to run them in a test host's network namespace,
`hicache.testing.netns_hosts`); readiness is then probed through the same prefix."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_with_bus() -> int:
    """A free loopback port whose cluster bus port (port + 10000) is free too."""
    for _ in range(100):
        port = free_port()
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("found no free port p with p + 10000 free in 100 tries")


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


class RedisClusterServers:
    """A Redis Cluster of `masters` masters with `replicas_per_master` replicas each, every
    node a redis-server on a free port of `host` (no persistence, `cluster-node-timeout`
    `node_timeout_ms`: a dead master is failed over by its replica within a few seconds).

    Lifecycle: `start()` launches the nodes, joins them with `redis-cli --cluster create`
    and waits until every node reports `cluster_state:ok`, all 16384 slots assigned and every
    replica attached; `kill_master(i)` SIGKILLs one master (its replica takes over);
    `wait_ok()` waits for the cluster to be whole again; `stop()` kills every node by pid.
    Every command — the servers, `redis-cli` for create and for each readiness check — runs
    behind `command_prefix` (e.g. `("ip", "netns", "exec", "ns-a")`), so the cluster works
    the same inside a network namespace whose address (`host`) this process cannot reach."""

    def __init__(
        self,
        workdir: Path,
        *,
        masters: int = 3,
        replicas_per_master: int = 1,
        host: str = "127.0.0.1",
        command_prefix: Sequence[str] = (),
        node_timeout_ms: int = 1000,
    ):
        if masters < 3:
            raise ValueError(f"masters={masters}: redis-cli --cluster create needs at least 3")
        if replicas_per_master < 0:
            raise ValueError(f"replicas_per_master={replicas_per_master}: must be >= 0")
        server = find_binary("redis-server")
        cli = find_binary("redis-cli")
        if server is None or cli is None:
            missing = "redis-server" if server is None else "redis-cli"
            raise FileNotFoundError(f"{missing} is not installed")
        self.server_binary = server
        self.cli_binary = cli
        self.workdir = workdir
        self.host = host
        self.command_prefix = tuple(command_prefix)
        self.node_timeout_ms = node_timeout_ms
        self.replicas_per_master = replicas_per_master
        self.ports = [free_port_with_bus() for _ in range(masters * (1 + replicas_per_master))]
        self.masters = masters
        self.processes: dict[int, subprocess.Popen[bytes]] = {}  # port -> its node

    @property
    def seed_url(self) -> str:
        """One node as a `redis+cluster://` URL (redis-py discovers the rest from it)."""
        return f"redis+cluster://{self._address(self.ports[0])}"

    @property
    def seeds_url(self) -> str:
        """Every node as a comma-separated seed list."""
        return "redis+cluster://" + ",".join(self._address(p) for p in self.ports)

    def _address(self, port: int) -> str:
        return f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"

    def cli(self, port: int, *args: str, timeout_s: float = 5.0) -> str:
        """`redis-cli -h host -p port ARGS` behind the prefix; its stdout ('' if it failed)."""
        command = [*self.command_prefix, self.cli_binary, "-h", self.host, "-p", str(port)]
        try:
            done = subprocess.run(
                [*command, *args], capture_output=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            return ""
        return done.stdout.decode(errors="replace") if done.returncode == 0 else ""

    def start(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            for port in self.ports:
                node_dir = self.workdir / f"node-{port}"
                node_dir.mkdir(parents=True, exist_ok=True)
                self.processes[port] = subprocess.Popen(
                    [*self.command_prefix, *self._node_command(port, node_dir)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            for port in self.ports:
                self._wait(partial(self._pings, port), deadline)
            create = [
                *self.command_prefix,
                self.cli_binary,
                "--cluster",
                "create",
                *(self._address(p) for p in self.ports),
                "--cluster-replicas",
                str(self.replicas_per_master),
                "--cluster-yes",
            ]
            done = subprocess.run(
                create,
                capture_output=True,
                timeout=max(1.0, deadline - time.monotonic()),
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(
                    f"redis-cli --cluster create exited {done.returncode}: "
                    f"{done.stdout.decode(errors='replace')[-500:]}"
                )
            self.wait_ok(max(0.1, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise

    def _node_command(self, port: int, node_dir: Path) -> list[str]:
        return [
            self.server_binary,
            "--port",
            str(port),
            "--bind",
            self.host,
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(node_dir / "nodes.conf"),
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
            "--cluster-replica-validity-factor",
            "0",  # a replica always takes over, however long since it heard its master
            "--repl-diskless-sync-delay",
            "0",  # replicas sync at once, not after the default 5 s
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",  # no password: bound beyond loopback (a test host's address) it would refuse
            "--dir",
            str(node_dir),
        ]

    def _wait(self, ready: Callable[[], bool], deadline: float) -> None:
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster on {self.host} not ready in time")
            time.sleep(0.05)

    def _roles(self, port: int) -> list[tuple[int, str]] | None:
        """(port, "master" or "slave") of each healthy node that one of ours, as the node on
        `port` sees it (None if it does not answer)."""
        lines = self.cli(port, "CLUSTER", "NODES").splitlines()
        if not lines:
            return None
        roles = []
        for line in lines:
            fields = line.split()
            node_port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            flags = fields[2].split(",")
            if node_port in self.processes and "fail" not in flags and "fail?" not in flags:
                roles.append((node_port, "master" if "master" in flags else "slave"))
        return roles

    def _whole(self, port: int, replicas: int) -> bool:
        info = self.cli(port, "CLUSTER", "INFO")
        if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
            return False
        roles = self._roles(port)
        if roles is None:
            return False
        masters = sum(1 for _, role in roles if role == "master")
        return masters == self.masters and len(roles) - masters >= replicas

    def wait_ok(self, timeout_s: float = 15.0, *, replicas: int | None = None) -> None:
        """Until every live node says `cluster_state:ok` with all slots served, sees
        `masters` live masters (a killed one's replica promoted) and at least `replicas`
        healthy replicas (default: as created)."""
        want = self.masters * self.replicas_per_master if replicas is None else replicas
        deadline = time.monotonic() + timeout_s
        for port in list(self.processes):
            self._wait(partial(self._whole, port, want), deadline)
        for port, role in self._roles(next(iter(self.processes))) or []:
            if role == "slave":  # synced: a replica that never was cannot take over
                self._wait(partial(self._synced, port), deadline)

    def _pings(self, port: int) -> bool:
        return self.cli(port, "PING").startswith("PONG")

    def _synced(self, port: int) -> bool:
        return "master_link_status:up" in self.cli(port, "INFO", "replication")

    def master_ports(self) -> list[int]:
        """The live masters' ports, as a live node's `CLUSTER NODES` says, in port order."""
        for port in self.processes:
            roles = self._roles(port)
            if roles is not None:
                return sorted(p for p, role in roles if role == "master")
        raise RuntimeError(f"no node of the cluster on {self.host} answers CLUSTER NODES")

    def kill_master(self, index: int) -> int:
        """SIGKILL the `index`-th live master (in port order); returns its port."""
        masters = self.master_ports()
        if not 0 <= index < len(masters):
            raise IndexError(f"master {index}: the cluster has {len(masters)} live masters")
        port = masters[index]
        process = self.processes.pop(port)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
        return port

    def stop(self) -> None:
        for port, process in list(self.processes.items()):
            process.kill()
            process.wait(timeout=10)
            del self.processes[port]


class MooncakeSegmentHolder(_Server):
    """Mooncake's own `mooncake_client`: a client of `master` that mounts `segment_bytes` of
    its memory into the store and holds it, storing and reading nothing itself. Objects that
    writers with no segment of their own (`global_segment_bytes: 0`) put land here, so they
    outlive those writers. Ready when its HTTP health endpoint answers healthy (it serves
    that only once its segment is mounted)."""

    binary_name = "mooncake_client"

    def __init__(self, master: MooncakeMaster, *, segment_bytes: int = 256 << 20) -> None:
        super().__init__()
        self.master = master
        self.segment_bytes = segment_bytes
        self.port = free_port()
        self.http_port = free_port()

    def _command(self) -> list[str]:
        return [
            *self.master.command_prefix,
            self.binary,
            f"--master_server_address={self.master.address}",
            "--metadata_server=P2PHANDSHAKE",
            f"--host={self.master.host}",
            f"--port={self.port}",
            f"--global_segment_size={self.segment_bytes}",
            "--protocol=tcp",
            "--enable_http_server=true",
            f"--http_port={self.http_port}",
        ]

    def _ready(self) -> bool:
        try:
            with socket.create_connection((self.master.host, self.http_port), timeout=0.2) as s:
                s.sendall(b"GET /health HTTP/1.0\r\nHost: x\r\n\r\n")
                return b'"healthy"' in s.recv(512)
        except OSError:
            return False
