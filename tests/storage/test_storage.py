"""L3 tier without servers: object format, the file backend, the guarded store (verification,
timeouts, breaker), and fault injection. No exception may reach the caller."""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from hicache.errors import ObjectCorruptError
from hicache.storage import (
    BreakerState,
    CircuitBreaker,
    FileBackend,
    GuardedStore,
)
from hicache.storage.backend import Buffer, StorageBackend
from hicache.storage.object_format import HEADER_BYTES, decode, encode
from hicache.testing.faulty_storage import FaultyBackend


def test_object_format_round_trip_and_every_corruption() -> None:
    data = encode(b"key-1", b"payload" * 100)
    assert bytes(decode(b"key-1", data)) == b"payload" * 100
    with pytest.raises(ObjectCorruptError, match=r"^object 6b65792d32: holds key 6b65792d31$"):
        decode(b"key-2", data)
    flipped = bytearray(data)
    flipped[-1] ^= 1
    with pytest.raises(ObjectCorruptError, match=r"^object 6b65792d31: payload checksum mismatch$"):
        decode(b"key-1", flipped)
    with pytest.raises(ObjectCorruptError, match=r"payload is 699 bytes; its header says 700$"):
        decode(b"key-1", data[:-1])
    with pytest.raises(ObjectCorruptError, match=r"header b'XXXX' v1; expected b'HKV1' v1$"):
        decode(b"key-1", b"XXXX" + data[4:])
    with pytest.raises(ObjectCorruptError, match=rf"shorter than the {HEADER_BYTES}-byte header$"):
        decode(b"key-1", data[:5])


@pytest.mark.asyncio
async def test_file_backend_atomic_restart_and_budget(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, capacity_bytes=3 * 1000)
    keys = [bytes([i]) * 16 for i in range(5)]
    assert await backend.put_many([(k, b"x" * 1000) for k in keys[:3]]) == [True] * 3
    assert await backend.get_many(keys[:1]) == [b"x" * 1000]  # key 0 is now most recent
    await backend.put_many([(keys[3], b"y" * 1000)])  # over budget: evicts the LRU key 1
    assert await backend.exists_many(keys[:4]) == [True, False, True, True]
    assert backend.used_bytes == 3000
    assert not list(tmp_path.glob("*/.tmp-*"))  # nothing half-written left behind
    # a crash mid-write leaves a temporary: removed at start once provably abandoned (here:
    # unwritten past the grace period; test_file_multiprocess has the dead-pid rule);
    # finished objects survive
    leftover = tmp_path / keys[0].hex()[:2] / ".tmp-deadbeef"
    leftover.write_bytes(b"partial")
    past = time.time() - 3600
    os.utime(leftover, (past, past))
    again = FileBackend(tmp_path, capacity_bytes=3 * 1000)
    assert len(again) == 3
    assert await again.get_many([keys[0], keys[1], keys[3]]) == [b"x" * 1000, None, b"y" * 1000]
    assert not list(tmp_path.glob("*/.tmp-*"))
    await again.delete_many([keys[0]])
    assert await again.exists_many([keys[0]]) == [False]


@pytest.mark.asyncio
async def test_corrupt_object_on_disk_is_dropped_and_counted(tmp_path: Path) -> None:
    store = GuardedStore(FileBackend(tmp_path, capacity_bytes=1 << 20))
    key = b"k" * 16
    assert await store.put([(key, b"page bytes" * 50)]) == [True]
    (path,) = tmp_path.glob("*/*.kv")
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    fetched = await store.fetch([key])
    assert fetched.values == [None]
    assert fetched.answered  # the backend answered: the object is definitively unusable
    assert store.stats.corrupt_dropped == 1
    assert not path.exists()  # deleted, so it is never handed out again
    assert await store.exists([key]) == [False]


@pytest.mark.asyncio
async def test_breaker_turns_a_dead_backend_into_misses_and_recovers(tmp_path: Path) -> None:
    now = [0.0]
    faulty = FaultyBackend(FileBackend(tmp_path, capacity_bytes=1 << 20))
    store = GuardedStore(faulty, breaker=CircuitBreaker(2, reset_after_s=5.0, clock=lambda: now[0]))
    key = b"a" * 16
    assert await store.put([(key, b"v" * 100)]) == [True]  # acknowledged while up
    faulty.down = True  # the server dies
    assert (await store.fetch([key])).answered is False  # a miss of unknown cause, not absence
    assert await store.get([key]) == [None]
    assert store.breaker.state is BreakerState.OPEN
    calls = faulty.calls
    assert await store.put([(b"b" * 16, b"w")]) == [False]  # open: the backend is not called
    assert faulty.calls == calls
    assert store.stats.skipped_open == 1
    assert store.stats.failures["get:TierUnavailableError"] == 2
    faulty.down = False  # the server is back
    now[0] = 5.0  # past the reset time: the next call is the trial
    assert store.breaker.state is BreakerState.HALF_OPEN
    got = await store.get([key])
    assert got[0] is not None
    assert bytes(got[0]) == b"v" * 100  # nothing acknowledged was lost
    assert store.breaker.state is BreakerState.CLOSED


@pytest.mark.asyncio
async def test_the_probe_lets_a_recovered_backend_in_without_waiting_for_the_reset(
    tmp_path: Path,
) -> None:
    """#32: the background probe takes the trial while the breaker is open — engine calls
    still wait `reset_after_s` — so an outage's end is seen within one probe interval. The
    clock never reaches the reset time here: only the probe can close the breaker."""
    now = [0.0]
    faulty = FaultyBackend(FileBackend(tmp_path, capacity_bytes=1 << 20))
    breaker = CircuitBreaker(1, reset_after_s=3600.0, clock=lambda: now[0])
    store = GuardedStore(faulty, breaker=breaker)
    key = b"k" * 16
    assert await store.put([(key, b"v" * 64)]) == [True]
    calls = faulty.calls
    assert await store.probe() is BreakerState.CLOSED  # closed: nothing to find out
    assert faulty.calls == calls  # no call made
    faulty.down = True
    assert await store.get([key]) == [None]
    assert breaker.state is BreakerState.OPEN
    assert await store.probe() is BreakerState.OPEN  # still down: the probe's call failed
    assert store.stats.failures["probe:TierUnavailableError"] == 1
    assert await store.get([key]) == [None]  # engine calls are refused, not made
    assert store.stats.skipped_open == 1
    faulty.down = False  # the outage ends
    assert await store.get([key]) == [None]  # engine calls still wait for the reset
    assert await store.probe() is BreakerState.CLOSED  # the probe's success closes it
    assert breaker.outages == 1
    got = await store.get([key])
    assert got[0] is not None
    assert bytes(got[0]) == b"v" * 64


@pytest.mark.asyncio
async def test_a_probe_that_timed_out_is_left_to_end_before_the_next(tmp_path: Path) -> None:
    """A backend whose calls outlast the probe's timeout (Mooncake's RPC timeout is longer
    than ours) gets one probe call at a time, never one per interval piling up."""
    faulty = FaultyBackend(FileBackend(tmp_path, capacity_bytes=1 << 20))
    store = GuardedStore(faulty, base_timeout_s=0.05, failure_threshold=1, reset_after_s=3600.0)
    faulty.down = True
    assert await store.get([b"k" * 16]) == [None]
    faulty.down, faulty.latency_s = False, 60.0  # back, but each call hangs a minute
    calls = faulty.calls
    assert await store.probe() is BreakerState.OPEN  # timed out: left running
    assert store.stats.failures["probe:timeout"] == 1
    assert faulty.calls == calls + 1
    assert await store.probe() is BreakerState.OPEN  # the first still runs: no second call
    assert faulty.calls == calls + 1
    assert store._probing is not None
    store._probing.cancel()  # (the test's stand-in for the hung call ending)
    await asyncio.gather(store._probing, return_exceptions=True)
    faulty.latency_s = 0.0
    assert await store.probe() is BreakerState.CLOSED
    assert faulty.calls == calls + 2


def test_one_trial_at_a_time_probe_or_engine_call() -> None:
    now = [0.0]
    breaker = CircuitBreaker(1, reset_after_s=5.0, clock=lambda: now[0])
    assert breaker.allow_probe() is False  # closed
    breaker.failure("get:timeout")
    assert breaker.allow_probe() is True  # open: the probe takes the trial
    assert breaker.allow_probe() is False  # one at a time
    now[0] = 5.0
    assert breaker.allow() is False  # half-open, but the probe's trial is in flight
    breaker.failure("probe:timeout")  # it failed: open again, from now
    assert breaker.state is BreakerState.OPEN
    now[0] = 10.0
    assert breaker.allow() is True  # an engine call's trial after the reset
    assert breaker.allow_probe() is False  # while it is in flight
    breaker.abandon()
    assert breaker.allow_probe() is True


@pytest.mark.asyncio
async def test_timeouts_scale_with_bytes_and_count_as_failures(tmp_path: Path) -> None:
    slow = FaultyBackend(FileBackend(tmp_path, capacity_bytes=1 << 20), latency_s=0.2)
    store = GuardedStore(slow, base_timeout_s=0.01, min_bandwidth_bytes_per_s=1e9)
    assert await store.put([(b"t" * 16, b"x")]) == [False]
    assert store.stats.failures["put:timeout"] == 1
    patient = GuardedStore(slow, base_timeout_s=0.01, min_bandwidth_bytes_per_s=100.0)
    assert await patient.put([(b"t" * 16, b"x" * 30)]) == [True]  # 30+ bytes at 100 B/s: 0.3 s


@pytest.mark.asyncio
async def test_injected_drops_and_corruption(tmp_path: Path) -> None:
    faulty = FaultyBackend(FileBackend(tmp_path, capacity_bytes=1 << 20), drop_rate=0.5, seed=3)
    store = GuardedStore(faulty)
    keys = [bytes([i]) * 16 for i in range(40)]
    stored = await store.put([(k, b"p" * 64) for k in keys])
    assert 5 < sum(stored) < 35  # some dropped, and the result says which
    assert await store.exists(keys) == stored
    faulty.drop_rate, faulty.corrupt_rate = 0.0, 1.0
    got = await store.get([k for k, ok in zip(keys, stored, strict=True) if ok])
    assert all(v is None for v in got)  # every corrupted read is a miss, never bad bytes
    assert store.stats.corrupt_dropped == sum(stored)


def test_file_backend_never_blocks_the_loop(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, capacity_bytes=64 << 20)

    async def main() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await backend.put_many([(bytes([i]) * 16, os.urandom(1 << 20)) for i in range(16)])
        task.cancel()
        return ticks

    assert asyncio.run(main()) > 1  # the loop kept running while files were written


class StuckBackend(StorageBackend):
    """Each put's thread (its call's slot, in call order) reports to `started`, reads the
    bytes only once `gate` is set (after the caller gave up) into `seen[slot]`, then sets
    `read[slot]`."""

    name = "stuck"

    def __init__(self) -> None:
        self.started: queue.Queue[None] = queue.Queue()  # one item per put that reached it
        self.gate = threading.Event()
        self.seen: list[list[bytes]] = []
        self.read: list[threading.Event] = []

    async def put_many(self, items):  # type: ignore[no-untyped-def]
        slot = len(self.seen)
        self.seen.append([])
        self.read.append(threading.Event())

        def hold(views: list[Buffer]) -> list[bool]:
            self.started.put(None)
            self.gate.wait(5)  # still reading the arena after the caller gave up
            self.seen[slot] = [bytes(v) for v in views]
            self.read[slot].set()
            return [True] * len(views)

        views = [memoryview(d) for _, d in items]
        return await asyncio.to_thread(hold, views)

    async def get_many(self, keys):  # type: ignore[no-untyped-def]
        return [None] * len(keys)

    async def exists_many(self, keys):  # type: ignore[no-untyped-def]
        return [False] * len(keys)

    async def delete_many(self, keys):  # type: ignore[no-untyped-def]
        return None


@pytest.mark.asyncio
@pytest.mark.parametrize("gives_up", ["timeout", "cancelled"])
async def test_arena_survives_a_put_still_running_after_its_caller_gave_up(
    gives_up: str,
) -> None:
    """A put whose caller gave up — its call timed out, or the caller was cancelled (the
    persist worker stopped, L3 detached) — while the backend's thread still reads the arena:
    the next put encodes elsewhere, so the first object's bytes stay intact."""
    backend = StuckBackend()
    timeout_s = 0.05 if gives_up == "timeout" else 60.0  # cancelled: the caller leaves first
    store = GuardedStore(backend, base_timeout_s=timeout_s, min_bandwidth_bytes_per_s=1e12)
    first = asyncio.create_task(store.put([(b"a" * 16, b"first")]))
    await asyncio.to_thread(backend.started.get, True, 60)  # its thread holds the arena
    if gives_up == "timeout":
        assert await first == [False]  # timed out, never raised
    else:
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
    second = asyncio.create_task(store.put([(b"b" * 16, b"other")]))
    await asyncio.to_thread(backend.started.get, True, 60)  # encoded, before the first reads
    backend.gate.set()
    assert await asyncio.to_thread(backend.read[0].wait, 60)  # the deadline bounds a hang only
    await second
    assert decode(b"a" * 16, backend.seen[0][0]).tobytes() == b"first"  # its bytes stayed intact


def test_an_object_from_parts_is_the_object_of_their_concatenation() -> None:
    from hicache.storage import object_format

    key, parts = b"k" * 16, [os.urandom(100), b"", os.urandom(3000)]
    whole = object_format.encode(key, b"".join(parts))
    assert object_format.encode(key, parts) == whole
    assert object_format.header(key, parts) + b"".join(parts) == whole
    assert bytes(object_format.decode(key, whole)) == b"".join(parts)


@pytest.mark.asyncio
async def test_file_fetch_into_verifies_each_object_as_it_lands(tmp_path: Path) -> None:
    """The file backend reports each object to `landed` once read (`streamed_get`), and the
    store verifies it there: good pages come back ok, a corrupted one is a counted miss,
    deleted, an absent one a plain miss — as when verified after the call."""
    backend = FileBackend(tmp_path, capacity_bytes=1 << 24)
    reported: list[int] = []
    real = backend._gets_parts

    def spy(keys, targets, landed=None):  # type: ignore[no-untyped-def]
        def noted(start: int, counts: Sequence[int]) -> None:
            reported.extend(range(start, start + len(counts)))
            assert landed is not None
            landed(start, counts)

        return real(keys, targets, noted if landed is not None else None)

    backend._gets_parts = spy  # type: ignore[method-assign]
    store = GuardedStore(backend, chunk_bytes=8192)
    items = [(bytes([i]) * 16, bytes([i]) * 4096) for i in range(5)]
    assert await store.put(items) == [True] * 5
    path = backend._path(items[2][0])
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    keys = [k for k, _ in items] + [b"\xee" * 16]
    pages = [[memoryview(bytearray(4096))] for _ in keys]
    fetched = await store.fetch_into(keys, pages)
    assert fetched.ok == [True, True, False, True, True, False]
    assert fetched.answered
    assert sorted(reported) == [0, 0, 0, 1, 1, 1]  # chunks of 2, 2, 2 keys: each reported
    assert [bytes(p[0]) for p in pages[:2]] == [d for _, d in items[:2]]
    assert store.stats.corrupt_dropped == 1
    assert not path.exists()


@pytest.mark.asyncio
async def test_stop_writes_ends_a_put_thread_after_its_current_object(tmp_path: Path) -> None:
    """A cancelled await does not stop the thread writing a batch (the process waits for it
    at exit); `stop_writes` (the drain's deadline) ends it after the object in hand."""

    in_hand = threading.Event()
    disk = threading.Event()  # a hung disk: the object in hand is written once this is set

    class HungDisk(FileBackend):
        def _put(self, key: bytes, parts: Sequence[Buffer]) -> bool:
            in_hand.set()
            disk.wait(60)  # in the backend's thread (the deadline bounds a hang only)
            return super()._put(key, parts)

    backend = HungDisk(tmp_path, capacity_bytes=1 << 24)
    items = [(bytes([i]) * 16, [b"x" * 100]) for i in range(20)]
    task = asyncio.ensure_future(backend.put_parts_many(items))
    assert await asyncio.to_thread(in_hand.wait, 60)  # the first object is being written
    backend.stop_writes()
    disk.set()  # the disk answers again: every later object would be written at once
    stored = await asyncio.wait_for(task, 60)
    assert stored == [True] + [False] * 19  # the object in hand, not the 19 left
    assert sum(await backend.exists_many([k for k, _ in items])) == sum(stored)


@pytest.mark.asyncio
async def test_l3_files_are_private_to_their_user(tmp_path: Path) -> None:
    """KV pages are as private as the engine's memory: directories 0700, objects 0600,
    whatever the umask."""
    old = os.umask(0o022)
    try:
        backend = FileBackend(tmp_path / "l3", capacity_bytes=1 << 20)
        assert await backend.put_many([(b"p" * 16, b"kv")]) == [True]
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "l3").rglob("*") if p.is_file()]
    dirs = [tmp_path / "l3", *(p for p in (tmp_path / "l3").rglob("*") if p.is_dir())]
    assert files
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in files), files
    assert all(p.stat().st_mode & 0o777 == 0o700 for p in dirs), dirs
