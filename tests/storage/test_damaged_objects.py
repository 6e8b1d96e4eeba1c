"""One damaged L3 object is a miss for its key, never an outage for everyone (issue #18, 8).

In place of one object: a directory, a FIFO, a socket, a symbolic link (to a valid object
elsewhere, and dangling), a file where the shard's directory goes, and regular files that are
no object (truncated, empty, a wrong header, a wrong checksum); for Redis, a list under the
object's key. Through `GuardedStore` over the real backends, each asserts: the damaged key is
a definite miss, the intact keys keep loading, the breaker stays closed however often the
damaged key is asked for, the damage is counted (`objects_damaged`, or `corrupt_dropped` for
regular files that fail verification) and shows in the service's store snapshot, and nothing
hangs (every call under a timeout; the start-up scan in a subprocess). Only the directory
itself gone — a backend-wide failure — feeds the breaker.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from hicache.service.snapshots import store_stats
from hicache.storage import BreakerState, FileBackend, GuardedStore, object_format
from hicache.testing.local_servers import RedisServer as RedisServerType
from tests.storage.servers import REDIS_CLIENT, RedisServer

REPO = Path(__file__).resolve().parents[2]
PAGE = 4096
WAIT_S = 10.0  # liveness bound: a blocked open of a FIFO would never return
ASKS = 6  # more than the breaker's threshold (3) of requests for the damaged prompt

INTACT = [bytes([0xA0 + i]) * 16 for i in range(4)]
DAMAGED = b"\x5d" * 16


def _path(root: Path, key: bytes) -> Path:
    name = key.hex()
    return root / name[:2] / f"{name}.kv"


def _object(key: bytes, payload: bytes) -> bytes:
    """The bytes the file backend holds for `key`: a valid object."""
    return object_format.encode(key, payload)


def _unblock_fifo(path: Path) -> None:
    """Let a reader stuck in a blocking open of `path` (a regression) return at teardown."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:  # ENXIO: nobody is blocked reading it
        if exc.errno not in (errno.ENXIO, errno.ENOENT, errno.EISDIR, errno.ENOTDIR):
            raise
        return
    os.close(fd)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"x")  # not empty: no rename may replace it


def _socket(path: Path) -> None:
    """Bound in a short folder, then moved into place: a worker's temporary folder under
    pytest-xdist is deeper than a Unix socket's 107-byte path allows."""
    short = Path(tempfile.mkdtemp(prefix="hc-sock-"))  # where pytest keeps tmp_path too
    try:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(short / "s"))
        sock.close()  # the socket file stays
        os.rename(short / "s", path)
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _link_to_valid_object_elsewhere(path: Path) -> None:
    elsewhere = path.parent.parent.parent / "elsewhere.kv"
    elsewhere.write_bytes(_object(DAMAGED, b"d" * PAGE))  # a *valid* object
    path.symlink_to(elsewhere)


def _dangling_link(path: Path) -> None:
    path.symlink_to(path.parent / "nothing-here")


def _link_to_fifo(path: Path) -> None:
    target = path.parent.parent.parent / "a-fifo"
    os.mkfifo(target)
    path.symlink_to(target)


NON_REGULAR: dict[str, Callable[[Path], None]] = {
    "directory": _directory,
    "fifo": _fifo,
    "socket": _socket,
    "link_elsewhere": _link_to_valid_object_elsewhere,
    "link_dangling": _dangling_link,
    "link_to_fifo": _link_to_fifo,
}


def _truncated(path: Path) -> None:
    path.write_bytes(_object(DAMAGED, b"d" * PAGE)[: PAGE // 2])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _wrong_header(path: Path) -> None:
    data = bytearray(_object(DAMAGED, b"d" * PAGE))
    data[:4] = b"NOPE"
    path.write_bytes(bytes(data))


def _wrong_checksum(path: Path) -> None:
    data = bytearray(_object(DAMAGED, b"d" * PAGE))
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


NOT_AN_OBJECT: dict[str, Callable[[Path], None]] = {
    "truncated": _truncated,
    "empty": _empty,
    "wrong_header": _wrong_header,
    "wrong_checksum": _wrong_checksum,
}


async def _stored(tmp_path: Path) -> tuple[GuardedStore, FileBackend]:
    backend = FileBackend(tmp_path / "l3", capacity_bytes=1 << 24)
    store = GuardedStore(backend)
    items = [(k, bytes([i]) * PAGE) for i, k in enumerate([*INTACT, DAMAGED])]
    assert await store.put(items) == [True] * len(items)
    return store, backend


async def _ask_everything(store: GuardedStore) -> None:
    """The damaged key and the intact ones, by every read path, ASKS times."""
    keys = [*INTACT, DAMAGED]
    for _ in range(ASKS):
        pages = [[memoryview(bytearray(PAGE))] for _ in keys]
        fetched = await asyncio.wait_for(store.fetch_into(keys, pages), WAIT_S)
        assert fetched.ok == [True] * len(INTACT) + [False]
        assert fetched.answered_keys == [True] * len(keys)  # a definite miss: not a failure
        for i, page in enumerate(pages[: len(INTACT)]):
            assert bytes(page[0]) == bytes([i]) * PAGE
        got = await asyncio.wait_for(store.fetch(keys, len(keys) * PAGE), WAIT_S)
        assert got.answered
        assert [v is not None for v in got.values] == [True] * len(INTACT) + [False]
        assert await asyncio.wait_for(store.exists(INTACT), WAIT_S) == [True] * len(INTACT)
        assert store.breaker.state is BreakerState.CLOSED


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", sorted(NON_REGULAR))
async def test_a_non_regular_file_in_place_of_an_object_is_a_counted_miss(
    tmp_path: Path, kind: str
) -> None:
    store, backend = await _stored(tmp_path)
    path = _path(backend.root, DAMAGED)
    path.unlink()
    NON_REGULAR[kind](path)
    try:
        await _ask_everything(store)
        assert not store.stats.failures, store.stats.failures  # nothing fed the breaker
        assert store.objects_damaged >= ASKS  # counted at each meeting
        snapshot = store_stats(store)
        assert snapshot is not None
        assert snapshot["objects_damaged"] == store.objects_damaged
        assert snapshot["breaker"] == "closed"
        assert await asyncio.wait_for(store.exists([DAMAGED]), WAIT_S) == [False]
        assert path.is_symlink() or path.exists()  # not ours: left where it is
        # a new put of the damaged key: refused onto a directory, replaces anything else
        again = await asyncio.wait_for(store.put([(DAMAGED, b"n" * PAGE)]), WAIT_S)
        assert again == [kind != "directory"]
        assert not store.stats.failures
    finally:
        _unblock_fifo(path)
        _unblock_fifo(tmp_path / "a-fifo")


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", sorted(NOT_AN_OBJECT))
async def test_a_regular_file_that_is_no_object_is_a_miss_deleted_and_counted(
    tmp_path: Path, kind: str
) -> None:
    store, backend = await _stored(tmp_path)
    path = _path(backend.root, DAMAGED)
    NOT_AN_OBJECT[kind](path)
    await _ask_everything(store)
    assert not store.stats.failures, store.stats.failures
    assert store.stats.corrupt_dropped == 1  # verified, deleted: the later asks are absent
    assert not path.exists()
    snapshot = store_stats(store)
    assert snapshot is not None
    assert snapshot["corrupt_dropped"] == 1


@pytest.mark.asyncio
async def test_a_file_where_a_shard_directory_goes_is_a_counted_miss(tmp_path: Path) -> None:
    store, backend = await _stored(tmp_path)
    path = _path(backend.root, DAMAGED)
    path.unlink()
    path.parent.rmdir()
    path.parent.write_bytes(b"not a directory")
    await _ask_everything(store)
    assert not store.stats.failures, store.stats.failures
    assert store.objects_damaged >= ASKS
    fresh = GuardedStore(FileBackend(backend.root, capacity_bytes=1 << 24))  # no shard cache
    assert await fresh.put([(DAMAGED, b"n" * PAGE)]) == [False]
    assert fresh.objects_damaged == 1
    assert not fresh.stats.failures
    assert fresh.breaker.state is BreakerState.CLOSED


_SCAN = """
import sys
from pathlib import Path
from hicache.storage import FileBackend
backend = FileBackend(Path(sys.argv[1]), capacity_bytes=1 << 24)
print(len(backend), backend.objects_damaged, backend.used_bytes)
"""


def test_the_start_up_scan_skips_every_kind_of_damage_without_hanging(tmp_path: Path) -> None:
    async def prepare() -> FileBackend:
        return (await _stored(tmp_path))[1]

    backend = asyncio.run(prepare())
    intact_bytes = sum(_path(backend.root, k).stat().st_size for k in INTACT)
    _path(backend.root, DAMAGED).unlink()
    made = []
    for n, (kind, make) in enumerate(sorted(NON_REGULAR.items())):
        key = bytes([0x10 + n]) * 16
        path = _path(backend.root, key)
        path.parent.mkdir(exist_ok=True)
        if kind == "link_to_fifo":
            target = tmp_path / "a-fifo"
            os.mkfifo(target)
            path.symlink_to(target)
        elif kind == "link_elsewhere":
            elsewhere = tmp_path / "elsewhere.kv"
            elsewhere.write_bytes(_object(key, b"e" * PAGE))
            path.symlink_to(elsewhere)
        else:
            make(path)
        made.append(path)
    try:
        scan = subprocess.run(
            [sys.executable, "-c", _SCAN, str(backend.root)],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=60,  # liveness: a scan that opened a FIFO would block here
        )
        assert scan.returncode == 0, scan.stderr
        listed, damaged, used = map(int, scan.stdout.split())
        assert listed == len(INTACT)
        assert damaged == len(NON_REGULAR)
        assert used == intact_bytes
    finally:
        for path in made:
            _unblock_fifo(path)
        _unblock_fifo(tmp_path / "a-fifo")


@pytest.mark.asyncio
async def test_the_directory_gone_is_a_backend_failure_that_opens_the_breaker(
    tmp_path: Path,
) -> None:
    store, backend = await _stored(tmp_path)
    for path in backend.root.glob("*/*"):
        path.unlink()
    for shard in backend.root.iterdir():
        shard.rmdir()
    backend.root.rmdir()
    page = [memoryview(bytearray(PAGE))]
    fetched = await asyncio.wait_for(store.fetch_into([INTACT[0]], [page]), WAIT_S)
    assert fetched.ok == [False]
    assert not fetched.answered  # no answer worth dropping the index's entry for
    # (keys the catalogue lists are answered from it; one it lacks goes to the disk)
    assert await asyncio.wait_for(store.exists([b"\x01" * 16]), WAIT_S) == [False]
    assert await asyncio.wait_for(store.put([(INTACT[2], b"p" * PAGE)]), WAIT_S) == [False]
    assert store.breaker.state is BreakerState.OPEN
    assert store.stats.failures["get:TierUnavailableError"] == 1
    assert store.objects_damaged == 0


# ---- Redis: a value of another type under an object's key -----------------------------


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServerType]:
    srv = RedisServer(tmp_path)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest_asyncio.fixture
async def redis_store(server: RedisServerType) -> AsyncIterator[GuardedStore]:
    pytest.importorskip("redis", reason=REDIS_CLIENT)
    from hicache.storage.redis_backend import RedisBackend

    backend = RedisBackend(server.url)
    store = GuardedStore(backend)
    items = [(k, bytes([i]) * PAGE) for i, k in enumerate([*INTACT, DAMAGED])]
    assert await store.put(items) == [True] * len(items)
    yield store
    await backend.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("command", ["rpush", "hset", "sadd"])
async def test_redis_a_wrong_type_under_a_key_is_a_per_key_miss(
    server: RedisServerType, redis_store: GuardedStore, command: str
) -> None:
    import redis.asyncio as aioredis  # the fixture skipped without it

    raw = aioredis.Redis.from_url(server.url)
    name = f"hicache:{{{DAMAGED.hex()}}}"
    store = redis_store
    try:
        for ask in range(ASKS):
            await raw.delete(name)
            if command == "hset":
                await raw.hset(name, "field", "value")
            else:
                await getattr(raw, command)(name, "value")
            got = await asyncio.wait_for(store.fetch([*INTACT, DAMAGED], PAGE), WAIT_S)
            assert got.answered  # a per-key miss, the call answered
            assert [bytes(v) if v is not None else None for v in got.values] == [
                *(bytes([i]) * PAGE for i in range(len(INTACT))),
                None,
            ]
            assert store.breaker.state is BreakerState.CLOSED
            assert store.objects_damaged == ask + 1
            assert await raw.exists(name) == 0  # under our prefix: ours to remove
        assert not store.stats.failures, store.stats.failures
        snapshot = store_stats(store)
        assert snapshot is not None
        assert snapshot["objects_damaged"] == ASKS
        # and a garbage string under the key: verified, deleted, counted as corrupt
        await raw.set(name, b"garbage")
        assert await store.get([DAMAGED]) == [None]
        assert store.stats.corrupt_dropped == 1
        assert store.breaker.state is BreakerState.CLOSED
    finally:
        await raw.aclose()


@pytest.mark.asyncio
async def test_a_shard_directory_that_is_a_link_is_never_followed(tmp_path: Path) -> None:
    """Review finding: O_NOFOLLOW guards the last path component only; a shard directory
    replaced by a link to elsewhere was followed by reads and by the start-up scan. Its
    objects are misses now (counted), even a valid one at the link's target; other shards
    serve on."""
    store, backend = await _stored(tmp_path)
    shard = _path(backend.root, DAMAGED).parent
    elsewhere = tmp_path / "elsewhere"
    shard.rename(elsewhere)  # the valid object now lies only at the link's target
    shard.symlink_to(elsewhere, target_is_directory=True)
    got = await asyncio.wait_for(store.fetch([*INTACT, DAMAGED], 5 * PAGE), WAIT_S)
    assert got.answered
    assert [v is not None for v in got.values] == [True] * len(INTACT) + [False]
    assert store.objects_damaged >= 1
    assert store.breaker.state is BreakerState.CLOSED
    assert not store.stats.failures
    rebuilt = FileBackend(tmp_path / "l3", capacity_bytes=1 << 24)  # the start-up scan
    assert rebuilt.objects_damaged == 1
    assert DAMAGED not in rebuilt._sizes
    assert all(key in rebuilt._sizes for key in INTACT)
