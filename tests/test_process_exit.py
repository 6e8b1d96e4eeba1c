"""A process that uses hicache exits when its main thread does — also when it raises before
`close()`, or never calls it — so a crashed engine is a dead process its supervisor restarts,
not a stuck one. Each case is a real child process with a timeout, one per kind of thread
hicache starts (the CPU copy worker, the fake backend's gated worker, the blocking client's
heartbeat thread, the async client's heartbeat task; the CUDA completion thread on a GPU);
and `close()` still finishes queued work and joins the thread before it returns."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.channel import protocol as p
from tests.conftest import REPO, shared_model

EXIT_WITHIN_S = 30.0  # importing torch takes a few seconds; a stuck process never exits

PRELUDE = f"""
import faulthandler
faulthandler.dump_traceback_later({EXIT_WITHIN_S - 5})  # a stuck child shows where it is
import asyncio, sys, threading, time
import torch
from hicache.model import LayerMap, load_layout
from hicache.scheduler import GroupPages
from hicache.transfer import CpuCopyBackend, Direction
from hicache.testing.fake_copies import FakeCopyBackend
from hicache.assembly import by_key

def build(backend=None):
    layer_map = LayerMap(load_layout(MODEL))
    return by_key.embedded(
        layer_map, dtype=torch.float16, page_size_tokens=2, host_capacity_bytes=1 << 22,
        device_pages=8, backend=backend,
    )

def walk_done(errors):
    print("walk done", len(errors), flush=True)

def hicache_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("hicache"))
"""


def run_child(body: str, *args: str, setup: str = "") -> subprocess.CompletedProcess[str]:
    model = str(shared_model("qwen2_7b.json"))
    code = f"MODEL = {model!r}\n{PRELUDE}\n{setup}\n{textwrap.dedent(body)}"
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            timeout=EXIT_WITHIN_S,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"the child did not exit within {EXIT_WITHIN_S} s (a thread kept it alive); "
            f"stderr: {(exc.stderr or b'').decode(errors='replace')[-2000:]}"
        )
    print(f"child exited {proc.returncode} after {time.monotonic() - started:.1f} s")
    return proc


def assert_crashed(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "RuntimeError: engine crashed" in proc.stderr, proc.stderr[-3000:]


def test_embedded_cache_raising_before_close_exits() -> None:
    """The CPU copy worker: an engine that built the stack, ran ops and raised."""
    proc = run_child(
        """
        cache = build()
        async def main():
            async with cache.scheduler.running() as sched:
                pages = {"full": GroupPages((0, 1))}
                assert (await (await sched.backup(pages)).done()).ok
        asyncio.run(main())
        raise RuntimeError("engine crashed")
        """
    )
    assert_crashed(proc)


def test_raising_inside_the_running_scheduler_exits() -> None:
    """The error escapes `running()` while a walk is in flight (a slow backend)."""
    proc = run_child(
        """
        cache = build(FakeCopyBackend(layer_delay_s=0.005))
        async def main():
            async with cache.scheduler.running() as sched:
                await sched.backup({"full": GroupPages((0, 1))})
                raise RuntimeError("engine crashed")
        asyncio.run(main())
        """
    )
    assert_crashed(proc)


def test_queued_walks_finish_at_exit_then_the_process_exits() -> None:
    """Walks still queued when the process exits without `close()` run to the end (their
    `done` is heard) and the worker is joined, then the process exits."""
    proc = run_child(
        """
        class Slow(CpuCopyBackend):
            def _run_layer(self, direction, position, parts):
                time.sleep(0.02)
        backend = Slow()
        for _ in range(3):
            backend.submit_walk(Direction.LOAD, [[object()]] * 10, walk_done)
        raise RuntimeError("engine crashed")
        """
    )
    assert_crashed(proc)
    assert proc.stdout.count("walk done 0") == 3, proc.stdout


def test_fake_backend_held_at_its_gate_exits() -> None:
    """A walk held at the fake's gate: exit opens it like `close()` does."""
    proc = run_child(
        """
        backend = FakeCopyBackend(gated=True)
        backend.submit_walk(Direction.LOAD, [[object()]] * 4, walk_done)
        raise RuntimeError("engine crashed")
        """
    )
    assert_crashed(proc)


def test_main_thread_ending_without_close_exits_zero() -> None:
    """Forgetting `close()` is not a crash: the process still ends, with status 0."""
    proc = run_child(
        """
        cache = build()
        print(hicache_threads(), flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hicache-cpu-copy" in proc.stdout


def test_close_finishes_queued_work_and_joins_the_thread() -> None:
    proc = run_child(
        """
        class Slow(CpuCopyBackend):
            def _run_layer(self, direction, position, parts):
                time.sleep(0.02)
        backend = Slow()
        cache = build(backend)
        backend.submit_walk(Direction.LOAD, [[object()]] * 10, walk_done)
        cache.close()
        print("closed", hicache_threads(), flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2:] == ["walk done 0", "closed []"], proc.stdout


# ---- the engine client: a stand-in sidecar that answers hello and heartbeats ---------------


class FakeSidecar:
    """Accepts connections on a Unix socket and answers every request with ok: hello with a
    short heartbeat timeout (so heartbeats flow), everything else with an empty result. The
    file `heard` appears once a heartbeat was counted (a child waits for it: heartbeats have
    flowed, whenever its threads got to run)."""

    def __init__(self, path: Path):
        self.path = path
        self.heartbeats = 0
        self.heard = path.with_name(path.name + ".heard")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        # the children exit at any point (that is what is tested): a reset or a broken pipe
        # is the peer gone, as an end of stream is
        with conn, contextlib.suppress(ConnectionError):
            while True:
                header = self._read(conn, p.HEADER.size)
                if header is None:
                    return
                (size,) = p.HEADER.unpack(header)
                body = self._read(conn, size)
                if body is None:
                    return
                request = p.unpack(body)
                op = request["op"]
                self.heartbeats += op == "heartbeat"
                if op == "heartbeat":
                    self.heard.touch()
                result = {"heartbeat_timeout_s": 0.3} if op == "hello" else {}
                conn.sendall(p.ok(request["id"], result))

    @staticmethod
    def _read(conn: socket.socket, n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def close(self) -> None:
        self._server.close()


@pytest.fixture
def fake_sidecar(tmp_path: Path) -> Iterator[FakeSidecar]:
    server = FakeSidecar(tmp_path / "s.sock")
    try:
        yield server
    finally:
        server.close()


CLIENT = """
import os
from hicache.client import connect, connect_async
layer_map = LayerMap(load_layout(MODEL))
address, heard = sys.argv[1], sys.argv[2]

def heartbeats_flowed():
    deadline = time.monotonic() + 20  # bounds a hang only
    while not os.path.exists(heard):  # the stand-in sidecar counted one
        assert time.monotonic() < deadline, "no heartbeat reached the sidecar"
        time.sleep(0.01)
"""


def test_client_with_heartbeats_raising_before_close_exits(fake_sidecar: FakeSidecar) -> None:
    """The blocking client's heartbeat thread (a daemon: it only keeps a session alive)."""
    proc = run_child(
        """
        client = connect(address, layer_map, page_size_tokens=2)
        heartbeats_flowed()
        assert any(t.name == "hicache-heartbeat" for t in threading.enumerate())
        raise RuntimeError("engine crashed")
        """,
        str(fake_sidecar.path),
        str(fake_sidecar.heard),
        setup=CLIENT,
    )
    assert_crashed(proc)
    assert fake_sidecar.heartbeats > 0


def test_async_client_raising_before_close_exits(fake_sidecar: FakeSidecar) -> None:
    """The async client's heartbeats are a task: `asyncio.run` cancels it on the way out."""
    proc = run_child(
        """
        async def main():
            client = await connect_async(address, layer_map, page_size_tokens=2)
            await asyncio.to_thread(heartbeats_flowed)  # the heartbeat task runs meanwhile
            raise RuntimeError("engine crashed")
        asyncio.run(main())
        """,
        str(fake_sidecar.path),
        str(fake_sidecar.heard),
        setup=CLIENT,
    )
    assert_crashed(proc)
    assert fake_sidecar.heartbeats > 0


def test_engine_with_embedded_cache_and_client_raising_exits(fake_sidecar: FakeSidecar) -> None:
    """Both at once, the way an engine process may hold them."""
    proc = run_child(
        """
        cache = build()
        client = connect(address, layer_map, page_size_tokens=2)
        raise RuntimeError("engine crashed")
        """,
        str(fake_sidecar.path),
        str(fake_sidecar.heard),
        setup=CLIENT,
    )
    assert_crashed(proc)


@pytest.mark.gpu
def test_cuda_backend_raising_before_close_exits() -> None:
    """The CUDA completion threads, with a walk that copied something."""
    proc = run_child(
        """
        from hicache.transfer.cuda_backend import CudaCopyBackend
        backend = CudaCopyBackend(0, staging_bytes=1 << 20)
        cache = build(backend)
        async def main():
            async with cache.scheduler.running() as sched:
                assert (await (await sched.backup({"full": GroupPages((0, 1))})).done()).ok
        asyncio.run(main())
        # one completion thread per copy stream (issue #36)
        assert {"hicache-cuda-complete-backup", "hicache-cuda-complete-load"} <= set(
            hicache_threads()
        )
        raise RuntimeError("engine crashed")
        """
    )
    assert_crashed(proc)


@pytest.mark.gpu
def test_cuda_backend_close_joins_its_thread() -> None:
    proc = run_child(
        """
        from hicache.transfer.cuda_backend import CudaCopyBackend
        backend = CudaCopyBackend(0, staging_bytes=1 << 20)
        cache = build(backend)
        cache.close()
        print("closed", hicache_threads(), flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "closed []", proc.stdout
