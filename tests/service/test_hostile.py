"""A sidecar that no engine can take down or reach across: hostile and broken engines against a
real `hicache serve`, with a bystander engine of another tenant (a process of its own, speaking
only `hicache.client`) doing store / load / verify round trips throughout. After every attack
the sidecar still serves and the bystander has seen zero errors, zero short loads and zero
wrong bytes.

The attacks: shrinking or punching its own memory, registering files that can shrink,
swapping the registered descriptor and reconnecting, registering another engine's memory (its
memfd opened through /proc), pipelining without
reading, half-open and garbage connections, SIGSTOP mid-load, SIGKILL (its memory must be
unmapped, nothing left in /dev/shm).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

from hicache.channel import protocol as p
from hicache.channel.counters import CounterFile
from hicache.channel.shm import sealed_memfd
from hicache.client import Client, ClientError, connect
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from tests.service.conftest import engine, read_event, write_config

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


@dataclass
class Arena:
    sidecar: SidecarProcess
    config: Path
    status: Path
    until: Path
    bystander: subprocess.Popen[str]
    seen_rounds: int = 0

    def client(self, tenant: str, **kwargs: Any) -> Client:
        loaded = load_deployment(self.config)
        return connect(
            loaded.deployment.service.socket_path,
            loaded.layer_map(),
            page_size_tokens=16,
            heartbeat=False,
            tenant=tenant,
            engine=f"attacker-{tenant}",
            **kwargs,
        )

    def bystander_totals(self) -> dict[str, Any]:
        totals: dict[str, Any] = json.loads(self.status.read_text())
        return totals

    def assert_bystander_unharmed(self, rounds: int = 3) -> None:
        """The bystander keeps completing exact round trips: `rounds` more from now."""
        assert self.bystander.poll() is None, self.bystander.communicate()
        start = self.bystander_totals()["rounds"]
        deadline = time.monotonic() + 60
        while self.bystander_totals()["rounds"] < start + rounds:
            assert time.monotonic() < deadline, "the bystander stopped making progress"
            time.sleep(0.05)
        totals = self.bystander_totals()
        assert (totals["errors"], totals["mismatches"], totals["short"]) == (0, 0, 0), totals
        assert totals["verified"] > 0
        assert self.sidecar.get_json("/healthz") is not None


@pytest.fixture(scope="module")
def arena(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Arena]:
    tmp = tmp_path_factory.mktemp("hostile")
    config = write_config(
        tmp, heartbeat_timeout_s=5, slow_reader_timeout_s=1.5, max_unread_reply_bytes=262144
    )
    sidecar = SidecarProcess(config, new_session=True).start()  # as under systemd
    status, until = tmp / "bystander.json", tmp / "stop"
    proc = engine(
        "bystander",
        config,
        "--tenant",
        "bystander",
        "--prompts",
        "3",
        "--until",
        str(until),
        "--status",
        str(status),
    )
    arena = Arena(sidecar, config, status, until, proc)
    try:
        assert read_event(proc)["event"] == "registered"
        deadline = time.monotonic() + 60
        while not status.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the bystander wrote no status"
            time.sleep(0.05)
        yield arena
        until.touch()
        out, err = proc.communicate(timeout=60)
        final = json.loads(out.strip().splitlines()[-1])
        assert (final["errors"], final["mismatches"], final["short"]) == (0, 0, 0), (final, err)
    finally:
        until.touch()
        with contextlib.suppress(Exception):
            proc.kill()
        assert sidecar.stop() == 0, config.with_suffix(".serve.log").read_text()


def stored(client: Client, tokens: list[int]) -> None:
    pools = client.create_pools(8)
    client.register_pools(pools)
    client.store(tokens, {"full": [0, 1]}, {"conv": {32: 2}})


def test_an_engine_cannot_shrink_what_the_sidecar_maps(arena: Arena, tmp_path: Path) -> None:
    """Defect: `os.truncate(pool_file, 0)` after a store, then a store, killed the sidecar
    (SIGBUS) and every engine with it. Pools are sealed memfds: nobody can shrink them, and a
    file that could shrink is refused at registration."""
    with arena.client("shrinker") as client:
        tokens = list(range(32))
        stored(client, tokens)
        assert client.pools is not None
        with pytest.raises(PermissionError):
            os.ftruncate(client.pools.fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(client.pools.fd, client.pools.nbytes + 4096)
        # a hole punched in its own memory reads back as zeros: no fault for the sidecar
        libc = ctypes.CDLL(None, use_errno=True)
        punched = libc.fallocate(
            client.pools.fd,
            FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
            ctypes.c_long(0),
            ctypes.c_long(client.pools.nbytes),
        )
        assert punched == 0, os.strerror(ctypes.get_errno())
        client.store(list(range(100, 132)), {"full": [0, 1]}, {"conv": {32: 2}})
        handle = client.load(tokens, {"full": [4, 5], "conv": [3]})
        assert handle is not None
        assert handle.done() == "done"
    # what could shrink is never mapped: a plain file, an unsealed memfd
    with arena.client("shrinker-2") as client:
        manifest = client.create_pools(8).manifest()
        counters = CounterFile.create(64)
        plain = os.open(tmp_path / "pool", os.O_RDWR | os.O_CREAT)
        in_shm = os.open(f"/dev/shm/hicache-hostile-{os.getpid()}", os.O_RDWR | os.O_CREAT)
        os.unlink(f"/dev/shm/hicache-hostile-{os.getpid()}")
        loose = os.memfd_create("loose")
        try:
            for fd, refusal in (
                (plain, "is not a memfd"),
                (in_shm, "is not a memfd"),  # tmpfs, but not the memfd mount: no seals
                (loose, "is not sealed against shrinking (F_SEAL_SHRINK)"),
            ):
                os.ftruncate(fd, manifest["nbytes"])
                with pytest.raises(ClientError) as info:
                    client.call(
                        "register_pools", {**manifest, "fd": fd, "counters_fd": counters.fd}
                    )
                assert refusal in info.value.message, info.value
        finally:
            os.close(plain)
            os.close(in_shm)
            os.close(loose)
            counters.close()
    arena.assert_bystander_unharmed()


def test_swapping_the_descriptor_under_a_registration(arena: Arena) -> None:
    """An engine that swaps what its pool's descriptor number holds (dup2 of another memfd)
    and reconnects: the sidecar maps what is there now only if it passes every check again;
    an unsealed or wrongly sized memfd is refused, and the old mapping went with the old
    session."""
    with arena.client("swapper") as client:
        stored(client, list(range(32)))
        assert client.pools is not None
        fd, nbytes = client.pools.fd, client.pools.nbytes
        for label, swapped in (
            ("unsealed", os.memfd_create("swap")),
            ("smaller", sealed_memfd("swap", nbytes - 4096)),
        ):
            if label == "unsealed":
                os.ftruncate(swapped, nbytes)
            os.dup2(swapped, fd)
            os.close(swapped)
            client._drop_socket()  # the next call reconnects and re-registers fd again
            with pytest.raises(ClientError) as info:
                client.lookup(list(range(32)))
            expected = {
                "unsealed": "is not sealed against shrinking",
                "smaller": f"nbytes {nbytes} does not match the memfd's size {nbytes - 4096}",
            }[label]
            assert expected in info.value.message, (label, info.value)
    arena.assert_bystander_unharmed()


def _controlling_tty(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[4])  # field 7: tty_nr


def test_a_terminal_sent_as_a_pool_never_becomes_the_sidecars(arena: Arena) -> None:
    """Review finding: opening an engine's descriptor for writing before looking at it would
    make a pty the sidecar's controlling terminal (a session leader without one takes the
    first it opens), and the engine could then SIGINT / SIGQUIT / SIGHUP it by writing ^C,
    ^\\ or closing the master. The sidecar takes descriptors with O_PATH and refuses anything
    off the memfd mount before opening it."""
    import pty

    assert _controlling_tty(arena.sidecar.pid) == 0  # started in a session of its own
    master, slave = pty.openpty()
    try:
        with arena.client("terminal") as client:
            pools = client.create_pools(8)
            counters = CounterFile.create(int(client.session["load_slots"]))
            try:
                for field in ("fd", "counters_fd"):
                    manifest = {**pools.manifest(), "counters_fd": counters.fd, field: slave}
                    with pytest.raises(ClientError) as info:
                        client.call("register_pools", manifest)
                    assert "is not a memfd" in info.value.message, info.value
            finally:
                counters.close()
                pools.close()
        assert _controlling_tty(arena.sidecar.pid) == 0
        os.write(master, b"\x03\x1c")  # would be SIGINT and SIGQUIT to a sidecar it owned
    finally:
        os.close(slave)
        os.close(master)
    arena.assert_bystander_unharmed()


def _bystander_pool_fd(pid: int) -> int:
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith(f"/memfd:hicache-pool-{pid}"):
                return int(name)
    raise AssertionError(f"no hicache pool memfd in /proc/{pid}/fd")


def test_a_session_cannot_register_another_engines_memory(arena: Arena) -> None:
    """Defect: an engine registered another engine's pool file and had the sidecar load its
    bytes into the victim's memory. Descriptors are taken from the socket's peer process only,
    and memory another session registered is refused even when reached through /proc."""
    victim = arena.bystander.pid
    victim_fd = _bystander_pool_fd(victim)
    # the victim's descriptor NUMBER, in our table, is never our pool: hold it with /dev/null
    # if it is free (otherwise it is one of this process's own files already)
    placeholder = None
    try:
        os.fstat(victim_fd)
    except OSError:
        placeholder = os.open(os.devnull, os.O_RDONLY)
        os.dup2(placeholder, victim_fd)
    with arena.client("thief") as client:
        pools = client.create_pools(8)
        counters = CounterFile.create(int(client.session["load_slots"]))
        manifest = {**pools.manifest(), "counters_fd": counters.fd}
        try:
            with pytest.raises(ClientError) as info:
                client.call("register_pools", {**manifest, "fd": victim_fd})
            assert info.value.code == "bad_request"
            assert f"descriptor {victim_fd} of engine pid {os.getpid()}" in info.value.message
            # the victim's memfd itself, opened through /proc (same uid), with a manifest
            # that fits it (the bystander's 64 pages): still refused, by identity
            probe = client.create_pools(64)
            stolen = os.open(f"/proc/{victim}/fd/{victim_fd}", os.O_RDWR)
            try:
                fits = {**probe.manifest(), "counters_fd": counters.fd, "fd": stolen}
                with pytest.raises(ClientError) as info:
                    client.call("register_pools", fits)
            finally:
                os.close(stolen)
                probe.close()
            assert info.value.code == "refused", info.value
            assert info.value.message.startswith(
                "register_pools: this memory is registered by session "
            )
            assert info.value.message.endswith(
                f"(test-bystander pid {victim}); a session registers memfds its own process created"
            )
            # and our own pool still registers and serves this session alone
            client.register_pools(pools)
            assert client.lookup(list(range(32))).tokens_total == 0
        finally:
            counters.close()
            if placeholder is not None:
                os.close(victim_fd)
                os.close(placeholder)
    arena.assert_bystander_unharmed()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _metric(arena: Arena, name: str) -> float:
    status, text = arena.sidecar.get("/metrics")
    assert status == 200, text
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _hello(sock: socket.socket, arena: Arena, tenant: str) -> None:
    loaded = load_deployment(arena.config)
    from hicache.assembly import geometries as deployment_geometries

    layer_map = loaded.layer_map()
    geometries = deployment_geometries(loaded.deployment, layer_map)
    hello = {
        "protocol": p.PROTOCOL_VERSION,
        "layout": p.layout_summary(layer_map, geometries, 16),
        "tenant": tenant,
    }
    sock.sendall(p.frame({"op": "hello", "id": 1, "args": hello}))
    (size,) = p.HEADER.unpack(sock.recv(4, socket.MSG_WAITALL))
    reply = msgpack.unpackb(sock.recv(size, socket.MSG_WAITALL))
    assert reply["ok"], reply


def test_a_client_that_never_reads_is_paused_then_dropped(arena: Arena) -> None:
    """Defect: 200k pipelined requests never read grew the sidecar by 154 MiB, never given
    back. Reading stops at the unread-reply mark; the connection is dropped after
    slow_reader_timeout_s (1.5 s here), counted; the sidecar's memory stays bounded."""
    socket_path = str(load_deployment(arena.config).deployment.service.socket_path)
    lookup = p.frame({"op": "lookup", "id": 2, "args": {"tokens": list(range(64))}})
    burst = lookup * 1000
    before = _rss_bytes(arena.sidecar.pid)
    dropped_before = _metric(arena, 'hicache_connections_dropped_total{reason="slow_reader"}')
    peak = before
    sent = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(socket_path)
        _hello(sock, arena, "flooder")
        sock.setblocking(False)
        deadline = time.monotonic() + 30
        closed = False
        pending = memoryview(burst)
        while sent < 200_000 * len(lookup) and time.monotonic() < deadline:
            try:
                n = sock.send(pending)
                sent += n
                pending = pending[n:] if n < len(pending) else memoryview(burst)
            except BlockingIOError:  # the sidecar stopped reading us: back-pressure
                peak = max(peak, _rss_bytes(arena.sidecar.pid))
                time.sleep(0.05)
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed, f"not dropped; sent {sent} bytes"
    peak = max(peak, _rss_bytes(arena.sidecar.pid))
    assert sent < 200_000 * len(lookup), "nothing pushed back"
    assert peak - before < 64 * 2**20, f"grew {(peak - before) / 2**20:.1f} MiB"
    dropped = _metric(arena, 'hicache_connections_dropped_total{reason="slow_reader"}')
    assert dropped == dropped_before + 1
    arena.assert_bystander_unharmed()


def test_half_open_garbage_and_silent_connections_go_away(arena: Arena) -> None:
    """Connections that stop mid-frame, never say hello, or send garbage are dropped at the
    heartbeat timeout (5 s here); garbage gets error replies; nobody else notices."""
    socket_path = str(load_deployment(arena.config).deployment.service.socket_path)
    baseline = len(arena.sidecar.get_json("/v1/stats")["sessions"])
    socks = []
    try:
        for i in range(6):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(socket_path)
            if i % 3 == 1:
                sock.sendall(b"\x10\x00")  # half a header
            elif i % 3 == 2:
                sock.sendall(p.HEADER.pack(100) + b"\x80" * 10)  # a tenth of a body
            socks.append(sock)
        garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        garbage.connect(socket_path)
        socks.append(garbage)
        for junk in (b"\xc1", b"\x93\x01\x02\x03", msgpack.packb({1: 2})):
            garbage.sendall(p.HEADER.pack(len(junk)) + junk)
            (size,) = p.HEADER.unpack(garbage.recv(4, socket.MSG_WAITALL))
            reply = msgpack.unpackb(garbage.recv(size, socket.MSG_WAITALL))
            assert reply["ok"] is False, reply
            assert reply["error"]["message"], reply
        deadline = time.monotonic() + 30
        while len(arena.sidecar.get_json("/v1/stats")["sessions"]) > baseline:
            assert time.monotonic() < deadline, "silent connections were never dropped"
            time.sleep(0.1)
        for sock in socks[:-1]:  # the sidecar closed its end: end of stream, or a reset
            sock.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(65536) == b""
    finally:
        for sock in socks:
            sock.close()
    arena.assert_bystander_unharmed()


def _maps_of(pid: int, needle: str) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if needle in line]


def _shm_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("hicache")}


def test_stopped_and_killed_engines_leave_nothing_behind(arena: Arena) -> None:
    """SIGSTOP mid-load: dropped at the heartbeat timeout, its pins released. SIGKILL: its
    memory is unmapped from the sidecar once its session ends (defect: it stayed mapped until
    the next copy), and no file is left in /dev/shm by anyone."""
    shm_before = _shm_files()
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        victim = engine("load-loop", arena.config, "--tenant", f"looper-{sig.name}")
        try:
            assert read_event(victim)["event"] == "registered"
            assert read_event(victim)["event"] == "looping"
            needle = f"memfd:hicache-pool-{victim.pid}"
            assert _maps_of(arena.sidecar.pid, needle), "the pool is not mapped by the sidecar"
            time.sleep(0.2)  # mid-load
            os.kill(victim.pid, sig)
            deadline = time.monotonic() + 30
            while _maps_of(arena.sidecar.pid, needle) or _maps_of(
                arena.sidecar.pid, f"memfd:hicache-counters-{victim.pid}"
            ):
                assert time.monotonic() < deadline, "a gone engine's memory is still mapped"
                time.sleep(0.1)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid, signal.SIGKILL)
            victim.wait(timeout=30)
    deadline = time.monotonic() + 30
    while True:  # the loads' pins went with their sessions (L3 writes let go once written)
        pinned = {
            ns["namespace"]: sum(g["pinned_pages"] for g in ns["groups"].values())
            for ns in arena.sidecar.get_json("/v1/stats")["namespaces"]
            if "looper-" in ns["namespace"]
        }
        assert len(pinned) == 2, pinned
        if not any(pinned.values()):
            break
        assert time.monotonic() < deadline, f"pins left: {pinned}"
        time.sleep(0.1)
    assert _shm_files() <= shm_before, _shm_files() - shm_before
    arena.assert_bystander_unharmed()


def test_a_killed_engine_is_unmapped_with_no_other_traffic(tmp_path: Path) -> None:
    """Defect: a dead engine's memory stayed mapped until the next copy (the copy thread
    held the last walk while it waited). Here nothing else copies after the kill."""
    config = write_config(tmp_path)
    with SidecarProcess(config) as proc:
        victim = engine("load-loop", config)
        try:
            assert read_event(victim)["event"] == "registered"
            assert read_event(victim)["event"] == "looping"
            time.sleep(0.2)
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(timeout=30)
            deadline = time.monotonic() + 30
            while _maps_of(proc.pid, f"memfd:hicache-pool-{victim.pid}") or _maps_of(
                proc.pid, f"memfd:hicache-counters-{victim.pid}"
            ):
                assert time.monotonic() < deadline, "a dead engine's memory is still mapped"
                time.sleep(0.1)
            assert not proc.get_json("/v1/stats")["sessions"]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid, signal.SIGKILL)


def test_a_sidecar_killed_outright_leaves_no_files(tmp_path: Path) -> None:
    """Defect: a crashed sidecar left its counter files in /dev/shm and a restarted one never
    removed them. Counters are the engines' memfds now: nothing is ever created there."""
    config = write_config(tmp_path)
    before = _shm_files()
    proc = SidecarProcess(config).start()
    try:
        worker = engine("load-loop", config)
        assert read_event(worker)["event"] == "registered"
        assert read_event(worker)["event"] == "looping"
        assert _shm_files() <= before
        os.kill(proc.pid, signal.SIGKILL)
        worker.communicate(timeout=60)  # its next call fails; it exits
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.stop()
    assert _shm_files() <= before


def test_errors_stay_errors_under_concurrent_attack(arena: Arena) -> None:
    """Several attackers at once (flood of refused registrations, bad frames, out-of-range
    pages) while the bystander works: every refusal is an error reply naming the problem."""
    failures: list[str] = []

    def attacker(n: int) -> None:
        try:
            with arena.client(f"pest-{n}") as client:
                pools = client.create_pools(4)
                client.register_pools(pools)
                for _ in range(50):
                    with pytest.raises(ClientError) as info:
                        client.store(list(range(32)), {"full": [0, 99]}, {"conv": {32: 0}})
                    assert info.value.code == "out_of_range", info.value
                    with pytest.raises(ClientError) as info:
                        client.call("register_pools", {})
                    assert info.value.code == "bad_request"
        except BaseException as exc:  # pytest.raises' Failed too: reported below
            failures.append(f"attacker {n}: {exc!r}")

    threads = [threading.Thread(target=attacker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures
    arena.assert_bystander_unharmed()


def test_ftruncate_refusal_is_the_kernels(tmp_path: Path) -> None:
    """What the seals promise, without a sidecar: shrinking and growing a pool fail EPERM."""
    fd = sealed_memfd("probe", 8192)
    try:
        for size in (0, 4096, 16384):
            with pytest.raises(PermissionError) as info:
                os.ftruncate(fd, size)
            assert info.value.errno == errno.EPERM
    finally:
        os.close(fd)
