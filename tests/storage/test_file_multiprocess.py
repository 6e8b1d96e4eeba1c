"""The file backend shared by several processes on one directory: objects another instance
or process persisted are found (and adopted into the catalogue), start-up removes only
temporaries that are provably abandoned, and a directory, FIFO or other non-regular file in
place of an object is a counted miss — never an exception for the breaker, never a hang."""

from __future__ import annotations

import asyncio
import errno
import os
import sys
import time
from pathlib import Path

import pytest

from hicache.storage import FileBackend, GuardedStore
from hicache.storage.file_backend import STALE_TMP_AFTER_S

REPO = Path(__file__).resolve().parents[2]
PAGE = 4096


def _path(root: Path, key: bytes) -> Path:
    name = key.hex()
    return root / name[:2] / f"{name}.kv"


async def _python(code: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        *args,
        stdout=asyncio.subprocess.PIPE,
        cwd=REPO,
    )


@pytest.mark.asyncio
async def test_a_second_instance_finds_and_adopts_what_the_first_persisted(
    tmp_path: Path,
) -> None:
    first = GuardedStore(FileBackend(tmp_path, capacity_bytes=1 << 20))
    second_backend = FileBackend(tmp_path, capacity_bytes=1 << 20)  # started before the puts
    second = GuardedStore(second_backend)
    keys = [bytes([i]) * 16 for i in range(3)]
    assert await first.put([(k, bytes([i]) * PAGE) for i, k in enumerate(keys)]) == [True] * 3
    assert len(second_backend) == 0
    assert await second.exists([*keys[:2], b"\xff" * 16]) == [True, True, False]
    assert len(second_backend) == 2  # adopted: counted in its budget, in its LRU
    assert second_backend.adopted == 2
    # a get of an object the catalogue never listed works, and adopts it too
    page = memoryview(bytearray(PAGE))
    fetched = await second.fetch_into([keys[2]], [[page]])
    assert fetched.ok == [True]
    assert bytes(page) == bytes([2]) * PAGE
    assert len(second_backend) == 3
    assert second_backend.used_bytes == first.backend.used_bytes  # type: ignore[attr-defined]


WRITER = """
import asyncio, sys
from pathlib import Path
from hicache.storage import FileBackend, GuardedStore

async def main():
    store = GuardedStore(FileBackend(Path(sys.argv[1]), capacity_bytes=1 << 20))
    ok = await store.put([(bytes([i]) * 16, bytes([i]) * 4096) for i in range(4)])
    print(sum(ok), flush=True)

asyncio.run(main())
"""


@pytest.mark.asyncio
async def test_objects_another_process_wrote_are_found_and_read(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, capacity_bytes=1 << 20)
    store = GuardedStore(backend)
    writer = await _python(WRITER, str(tmp_path))
    out, _ = await writer.communicate()
    assert out == b"4\n"
    keys = [bytes([i]) * 16 for i in range(4)]
    assert await store.exists(keys) == [True] * 4
    pages = [memoryview(bytearray(PAGE)) for _ in keys]
    fetched = await store.fetch_into(keys, [[p] for p in pages])
    assert fetched.ok == [True] * 4
    assert [bytes(p) for p in pages] == [bytes([i]) * PAGE for i in range(4)]


# a real put held between its write and its rename (os.replace blocks): a write in progress
IN_PROGRESS = """
import os, sys, time
from pathlib import Path
from hicache.storage import file_backend

def stuck(src, dst):
    print("writing", flush=True)
    time.sleep(600)

file_backend.os.replace = stuck
file_backend.FileBackend(Path(sys.argv[1]), capacity_bytes=1 << 20)._put(b"w" * 16, [b"x" * 100])
"""


@pytest.mark.asyncio
async def test_start_up_keeps_a_live_writers_temporary_and_removes_a_dead_ones(
    tmp_path: Path,
) -> None:
    writer = await _python(IN_PROGRESS, str(tmp_path))
    try:
        assert writer.stdout is not None
        assert await asyncio.wait_for(writer.stdout.readline(), 30) == b"writing\n"
        (tmp,) = tmp_path.glob("*/.tmp-*")
        assert str(writer.pid) in tmp.name  # the writer's pid is in the name
        FileBackend(tmp_path, capacity_bytes=1 << 20)  # another process starts meanwhile
        assert tmp.exists()  # the live writer's temporary is left alone
    finally:
        writer.kill()
        await writer.wait()
    again = FileBackend(tmp_path, capacity_bytes=1 << 20)
    assert not tmp.exists()  # its writer is dead: abandoned, removed
    assert again.removed_temporaries == 1


def test_temporaries_of_unknown_writers_are_removed_only_after_the_grace_period(
    tmp_path: Path,
) -> None:
    sub = tmp_path / "ab"
    sub.mkdir()
    fresh = sub / ".tmp-deadbeef"  # no writer id (an older version's name, or another host's)
    old = sub / ".tmp-cafebabe"
    elsewhere = sub / ".tmp-000000000000-1-0123abcd"  # another host / pid namespace, pid 1
    for p in (fresh, old, elsewhere):
        p.write_bytes(b"partial")
    past = time.time() - STALE_TMP_AFTER_S - 60
    os.utime(old, (past, past))
    backend = FileBackend(tmp_path, capacity_bytes=1 << 20)
    assert fresh.exists()
    assert elsewhere.exists()  # its pid means nothing here: judged by age only
    assert not old.exists()
    assert backend.removed_temporaries == 1
    FileBackend(tmp_path, capacity_bytes=1 << 20, stale_tmp_after_s=0.0)
    assert not fresh.exists()
    assert not elsewhere.exists()


def _unblock_fifo(path: Path) -> None:
    """Release a reader stuck opening `path` (today's code blocks there forever)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:  # ENXIO: nobody is blocked reading it
        if exc.errno not in (errno.ENXIO, errno.ENOENT):
            raise
        return
    os.close(fd)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["fifo", "directory"])
async def test_a_non_regular_file_in_place_of_an_object_is_a_counted_miss(
    tmp_path: Path, kind: str
) -> None:
    backend = FileBackend(tmp_path, capacity_bytes=1 << 20)
    store = GuardedStore(backend)
    known, unknown = b"k" * 16, b"u" * 16
    assert await store.put([(known, b"v" * PAGE)]) == [True]
    path = _path(tmp_path, known)
    path.unlink()
    other = _path(tmp_path, unknown)
    other.parent.mkdir(exist_ok=True)
    for p in (path, other):
        os.mkfifo(p) if kind == "fifo" else p.mkdir()
    try:
        page = memoryview(bytearray(PAGE))
        fetched = await asyncio.wait_for(store.fetch_into([known], [[page]]), 5)
        assert fetched.ok == [False]
        assert fetched.answered  # a definite miss, not a backend failure
        assert len(backend) == 0  # dropped from the catalogue
        assert await asyncio.wait_for(store.get([known]), 5) == [None]
        assert await asyncio.wait_for(store.exists([unknown]), 5) == [False]
        assert not store.stats.failures  # nothing fed the breaker
        assert backend.objects_damaged >= 3
        # a put onto a directory is refused for that key, not raised
        if kind == "directory":
            assert await store.put([(unknown, b"w" * PAGE)]) == [False]
            assert not store.stats.failures
        # start-up skips them too (and does not hang on the FIFO)
        restarted = await asyncio.wait_for(
            asyncio.to_thread(FileBackend, tmp_path, capacity_bytes=1 << 20), 5
        )
        assert len(restarted) == 0
        assert restarted.objects_damaged == 2
    finally:
        if kind == "fifo":
            for p in (path, other):
                _unblock_fifo(p)
