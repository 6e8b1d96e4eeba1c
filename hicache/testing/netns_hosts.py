"""`TwoHosts`: two test hosts on one machine, as two Linux network namespaces joined by a veth
pair (the cross-host tests and `benchmarks/cluster.py`). Needs root and iproute2's `ip`;
`available()` says why not, and tests skip with that reason.

Lifecycle: `TwoHosts()` sweeps namespaces left by dead processes (`hc<pid>-<n>a|b`), creates
`hc<pid>-<n>a` and `hc<pid>-<n>b`, a veth pair between them (each end named like its
namespace) with addresses of a /30 from 198.18.0.0/15 (chosen from the pid; the namespaces
see no other interface, so no address can clash with the machine's), loopback up in both ->
processes run in a host with `popen` / `run` (`ip netns exec`, also `command_prefix` for
servers that take one), or in-process code with `within` (a thread that joins the namespace
with setns: sockets it opens, and children it spawns, belong to that host) -> `link_down()` /
`link_up()` cut and restore B's end of the veth; `received_bytes(host)` counts what crossed
it -> `close()` deletes both namespaces (their veth ends with them), also after a failed
set-up. Processes still running in a namespace keep it alive after `close()`: stop them first.

Unix sockets are filesystem objects, so a process outside both namespaces still reaches a
sidecar's engine socket; the sidecar's own TCP connections (Mooncake, Redis, its HTTP port)
live in its namespace. A socket belongs to the namespace of the thread that opened it: a
client set up inside a host (Mooncake's) must also be called from threads inside it.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

T = TypeVar("T")
Host = Literal["a", "b"]
HOSTS: tuple[Host, Host] = ("a", "b")

CLONE_NEWNET = 0x40000000  # <sched.h>; os.setns arrived only in Python 3.12
NETNS_DIR = Path("/run/netns")  # where `ip netns add` mounts named namespaces
NAME_PATTERN = re.compile(r"^hc(\d+)-\d+[ab]$")
SUBNETS = 1 << 15  # /30s in 198.18.0.0/15
_serial = itertools.count()


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    """`ip ARGS`; one that hangs past 30 s is a failed command (returncode -1), not a raise."""
    try:
        return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(["ip", *args], -1, "", "timed out after 30 s")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def available() -> str | None:
    """None when this process can create network namespaces, else why it cannot."""
    if os.geteuid() != 0:
        return f"network namespaces need root; this process runs as uid {os.geteuid()}"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not on PATH (apt-get install iproute2)"
    probe = f"hc{os.getpid()}-{next(_serial)}a"
    added = _ip("netns", "add", probe)
    if added.returncode != 0:
        return f"`ip netns add {probe}` refused: {added.stderr.strip() or added.returncode}"
    # a veth pair inside the probe namespace (gone with it): namespaces without veth are no
    # test hosts either
    veth = _ip("-n", probe, "link", "add", "hcprobe0", "type", "veth", "peer", "name", "hcprobe1")
    deleted = _ip("netns", "delete", probe)
    if veth.returncode != 0:
        return f"a veth pair cannot be made: {veth.stderr.strip() or veth.returncode}"
    if deleted.returncode != 0:  # a namespace made but not removable: the hosts would leak
        return f"`ip netns delete {probe}` refused: {deleted.stderr.strip() or deleted.returncode}"
    return None


def sweep_stale() -> list[str]:
    """Delete `hc<pid>-<n>a|b` namespaces whose pid is no longer running; returns their names."""
    listed = _ip("netns", "list")
    removed = []
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = NAME_PATTERN.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _ip("netns", "delete", name)
            removed.append(name)
    return removed


def _setns(name: str) -> None:
    """Move the calling thread into namespace `name`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


class TwoHosts:
    """Hosts "a" and "b": `namespace`, `address` and `interface` of each."""

    def __init__(self) -> None:
        reason = available()
        if reason is not None:
            raise RuntimeError(f"cannot create test hosts: {reason}")
        sweep_stale()
        pid, serial = os.getpid(), next(_serial)
        self.namespace = {h: f"hc{pid}-{serial}{h}" for h in HOSTS}
        self.interface = dict(self.namespace)  # each veth end is named like its namespace
        subnet = (pid * 7 + serial) % SUBNETS  # a /30: .0 net, .1 a, .2 b, .3 broadcast
        base = (198 << 24) | (18 << 16) | (subnet << 2)
        self.address = {h: self._dotted(base + 1 + i) for i, h in enumerate(HOSTS)}
        self._created: list[str] = []
        try:
            for h in HOSTS:
                self._checked("netns", "add", self.namespace[h])
                self._created.append(self.namespace[h])
            a, b = self.namespace["a"], self.namespace["b"]
            self._checked(
                "link", "add", self.interface["a"], "netns", a,
                "type", "veth", "peer", "name", self.interface["b"], "netns", b,
            )  # fmt: skip
            for h in HOSTS:
                ns = self.namespace[h]
                self._checked("-n", ns, "link", "set", "lo", "up")
                self._checked(
                    "-n", ns, "addr", "add", f"{self.address[h]}/30", "dev", self.interface[h]
                )
                self._checked("-n", ns, "link", "set", self.interface[h], "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _dotted(value: int) -> str:
        return ".".join(str((value >> shift) & 0xFF) for shift in (24, 16, 8, 0))

    @staticmethod
    def _checked(*args: str) -> None:
        done = _ip(*args)
        if done.returncode != 0:
            raise RuntimeError(
                f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}"
            )

    def command_prefix(self, host: Host) -> tuple[str, ...]:
        """What runs a command in `host`: prepend it to an argv."""
        return ("ip", "netns", "exec", self.namespace[host])

    def popen(self, host: Host, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen([*self.command_prefix(host), *argv], **kwargs)

    def run(
        self, host: Host, argv: Sequence[str], **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        return subprocess.run([*self.command_prefix(host), *argv], **kwargs)

    def within(self, host: Host, fn: Callable[[], T]) -> T:
        """`fn()` on a thread inside `host`'s namespace (its sockets and its children are
        there); its result, or its exception re-raised here."""
        out: list[T] = []
        failed: list[BaseException] = []

        def body() -> None:
            try:
                _setns(self.namespace[host])
                out.append(fn())
            except BaseException as exc:  # handed to the caller's thread
                failed.append(exc)

        thread = threading.Thread(target=body, name=f"netns-{self.namespace[host]}")
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
        return out[0]

    def link_down(self) -> None:
        """Cut B's end of the veth: B reaches nothing of A's (its route to A is gone)."""
        self._checked("-n", self.namespace["b"], "link", "set", self.interface["b"], "down")

    def link_up(self) -> None:
        self._checked("-n", self.namespace["b"], "link", "set", self.interface["b"], "up")

    def received_bytes(self, host: Host) -> int:
        """Bytes `host`'s end of the veth has received (the kernel's counter)."""
        shown = _ip(
            "-n", self.namespace[host], "-j", "-s", "link", "show", "dev", self.interface[host]
        )
        if shown.returncode != 0:
            raise RuntimeError(
                f"`ip -n {self.namespace[host]} -j -s link show dev {self.interface[host]}` "
                f"failed ({shown.returncode}): {shown.stderr.strip()}"
            )
        (link,) = json.loads(shown.stdout)
        return int(link["stats64"]["rx"]["bytes"])

    def close(self) -> None:
        for name in reversed(self._created):
            _ip("netns", "delete", name)
        self._created.clear()

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
