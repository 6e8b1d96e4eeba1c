"""The mooncake backend against a real mooncake_master on loopback (TCP, P2PHANDSHAKE):
round trips with upsert semantics, a master killed mid-run (misses, breaker opens, closes
after restart), and corruption detected by the object header."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from hicache.storage import BreakerState, CircuitBreaker, GuardedStore
from hicache.testing.local_servers import MooncakeMaster as MooncakeMasterType
from tests.storage.servers import MooncakeMaster, started

try:
    import mooncake.store  # noqa: F401

    from hicache.storage.mooncake_backend import MooncakeBackend
except ImportError:  # pragma: no cover - depends on the platform's wheel
    if os.environ.get("CI"):
        raise
    pytest.skip("mooncake-transfer-engine is not installed", allow_module_level=True)


@pytest.fixture
def master() -> Iterator[MooncakeMasterType]:
    with started(MooncakeMaster()) as srv:
        yield srv


@pytest_asyncio.fixture
async def backend(master: MooncakeMasterType) -> AsyncIterator[MooncakeBackend]:
    b = await asyncio.to_thread(
        MooncakeBackend, master.address, global_segment_bytes=64 << 20, local_buffer_bytes=64 << 20
    )
    yield b
    await b.close()


@pytest.mark.asyncio
async def test_round_trip_and_upsert(backend: MooncakeBackend) -> None:
    store = GuardedStore(backend)
    items = [(bytes([i]) * 16, bytes([i]) * 4096) for i in range(16)]
    assert await store.put(items) == [True] * 16
    got = await store.get([k for k, _ in items] + [b"\xff" * 16])
    assert [bytes(v) if v is not None else None for v in got] == [d for _, d in items] + [None]
    assert await store.put([(items[0][0], b"new")]) == [True]  # upsert replaces
    (value,) = await store.get([items[0][0]])
    assert value is not None
    assert bytes(value) == b"new"
    assert await store.exists([items[1][0], b"\xee" * 16]) == [True, False]


@pytest.mark.asyncio
async def test_master_killed_mid_run_then_restarted(
    master: MooncakeMasterType, backend: MooncakeBackend
) -> None:
    now = [0.0]
    store = GuardedStore(
        backend, breaker=CircuitBreaker(2, reset_after_s=1.0, clock=lambda: now[0])
    )
    key = b"m" * 16
    assert await store.put([(key, b"v" * 1000)]) == [True]
    master.stop()
    assert await store.put([(b"n" * 16, b"w")]) == [False]  # no exception reaches the caller
    assert await store.exists([key]) == [False]
    assert store.breaker.state is BreakerState.OPEN
    master.start()
    now[0] = 1.0
    deadline = time.monotonic() + 60  # bounds a hang only (#26: a busy machine)
    while time.monotonic() < deadline:  # the client reconnects by itself; a trial closes it
        if await store.put([(key, b"again")]) == [True]:
            break
        now[0] += 1.0
        await asyncio.sleep(0.1)
    assert store.breaker.state is BreakerState.CLOSED
    (value,) = await store.get([key])
    assert value is not None
    assert bytes(value) == b"again"


@pytest.mark.asyncio
async def test_corrupt_object_is_a_miss_and_removed(backend: MooncakeBackend) -> None:
    store = GuardedStore(backend)
    key = b"z" * 16
    await backend.put_many([(key, b"not an hicache object")])  # bypasses the header
    assert await store.get([key]) == [None]
    assert store.stats.corrupt_dropped == 1
    assert await backend.exists_many([key]) == [False]


@pytest.mark.asyncio
async def test_zero_copy_put_and_scatter_fetch(
    master: MooncakeMasterType, backend: MooncakeBackend
) -> None:
    store = GuardedStore(backend)
    host = memoryview(bytearray(9 * 8192))
    backend.register_memory(host)
    targets = [[host[i * 8192 : (i + 1) * 8192]] for i in range(9)]
    items = [(bytes([i]) * 16, os.urandom(8192)) for i in range(8)]
    assert await store.put(items) == [True] * 8  # sent from the registered put arena
    keys = [k for k, _ in items] + [b"\xfe" * 16]
    ok, answered = await store.fetch_into(keys, targets)
    assert answered
    # an absent key is a miss (OBJECT_NOT_FOUND), not a failure
    assert ok == [True] * 8 + [False]
    assert [bytes(host[i * 8192 : (i + 1) * 8192]) for i in range(8)] == [d for _, d in items]
    # an object corrupted in the store is caught in the host page, dropped and counted
    bad = bytearray(object_format_encode(items[0][0], items[0][1]))
    bad[-1] ^= 1
    await backend.put_many([(items[0][0], bytes(bad))])
    assert tuple(await store.fetch_into([items[0][0]], [targets[0]])) == ([False], True)
    assert store.stats.corrupt_dropped == 1
    assert await backend.exists_many([items[0][0]]) == [False]
    # the master down: the fetch did not get an answer, so nothing is dropped from an index
    master.stop()
    assert tuple(await store.fetch_into([items[1][0]], [targets[1]])) == ([False], False)


def object_format_encode(key: bytes, payload: bytes) -> bytes:
    from hicache.storage import object_format

    return object_format.encode(key, payload)


@pytest.mark.asyncio
async def test_scatter_fetch_into_registered_host_memory(backend: MooncakeBackend) -> None:
    store = GuardedStore(backend)
    host = memoryview(bytearray(4 * 8192))
    backend.register_memory(host)
    items = [(bytes([i]) * 16, os.urandom(8192)) for i in range(3)]
    assert await store.put(items) == [True] * 3
    # each page lands in two chunks of the host buffer (as layer_first pages do)
    targets = [
        [host[i * 8192 : i * 8192 + 4096], host[i * 8192 + 4096 : (i + 1) * 8192]] for i in range(4)
    ]
    ok, answered = await store.fetch_into([k for k, _ in items] + [b"\xfd" * 16], targets)
    assert answered
    assert ok == [True, True, True, False]
    assert [bytes(host[i * 8192 : (i + 1) * 8192]) for i in range(3)] == [d for _, d in items]
    # an object of another size is present but not ours: a verified miss, dropped and counted
    await backend.put_many([(b"\x07" * 16, b"short")])
    ok, answered = await store.fetch_into([b"\x07" * 16], [targets[3]])
    assert (ok, answered) == ([False], True)
    assert store.stats.corrupt_dropped == 1
    # memory nobody registered is refused, not read into
    stray = memoryview(bytearray(8192))
    ok, answered = await store.fetch_into([items[0][0]], [[stray]])
    assert (ok, answered) == ([False], False)


# ---- status codes: absent (a miss), backend failure (breaker; nothing deleted), another
# size (a verified miss: deleted) -------------------------------------------------------------

WRITER = """
import sys, time, asyncio
from hicache.storage import GuardedStore
from hicache.storage.mooncake_backend import MooncakeBackend

async def main():
    backend = MooncakeBackend(sys.argv[1], global_segment_bytes=16 << 20, local_buffer_bytes=16 << 20)
    store = GuardedStore(backend)
    assert await store.put([(bytes([i]) * 16, bytes([i]) * 8192) for i in range(4)]) == [True] * 4
    print("ready", flush=True)
    time.sleep(600)

asyncio.run(main())
"""


def _registered_pages(backend: MooncakeBackend, count: int, size: int) -> list[list[memoryview]]:
    host = memoryview(bytearray(count * size))
    backend.register_memory(host)
    return [[host[i * size : (i + 1) * size]] for i in range(count)]


@pytest.mark.asyncio
async def test_a_dead_segment_owner_is_a_failure_not_a_corrupt_object(
    master: MooncakeMasterType,
) -> None:
    """Real TRANSFER_FAIL (-800) with targets of the right size: the objects live in another
    client's segment, and that client is killed. The master still lists them (get_size,
    is_exist) until the client's lease lapses (~10 s); they must not be deleted or counted
    corrupt, and the index must keep them (answered False)."""
    writer = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        WRITER,
        master.address,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert writer.stdout is not None
        assert await asyncio.wait_for(writer.stdout.readline(), 60) == b"ready\n"
        # the reader joins after the puts, so the objects are all in the writer's segment
        reader = await asyncio.to_thread(
            MooncakeBackend,
            master.address,
            global_segment_bytes=16 << 20,
            local_buffer_bytes=16 << 20,
        )
        try:
            # patient: the failed transfer retries its connection for ~1 s before -800
            store = GuardedStore(reader, base_timeout_s=10.0)
            targets = _registered_pages(reader, 2, 8192)
            fetched = await store.fetch_into([b"\x00" * 16, b"\x01" * 16], targets)
            assert fetched.ok == [True, True]  # alive: both read
            writer.kill()
            await writer.wait()
            fetched = await store.fetch_into([b"\x02" * 16, b"\x03" * 16], targets)
            assert not fetched.timed_out
            assert fetched.ok == [False, False]
            assert store.stats.corrupt_dropped == 0
            assert fetched.answered_keys == [False, False]
            assert not fetched.answered  # the index keeps its entries
            assert store.stats.failures["get:key_failed"] == 2
            assert await reader.exists_many([b"\x02" * 16, b"\x03" * 16]) == [True, True]
        finally:
            await reader.close()
    finally:
        if writer.returncode is None:
            writer.kill()
            await writer.wait()


@pytest.mark.asyncio
async def test_master_down_plain_get_is_a_failure_not_absence(
    master: MooncakeMasterType, backend: MooncakeBackend
) -> None:
    """get_batch returns empty values both for an absent key and for a dead master."""
    store = GuardedStore(backend)
    key = b"g" * 16
    assert await store.put([(key, b"v" * 1000)]) == [True]
    assert (await store.fetch([b"\xaa" * 16])).answered  # absent while the master is up
    master.stop()
    fetched = await store.fetch([key])
    assert fetched.values == [None]
    assert not fetched.answered
    assert store.stats.corrupt_dropped == 0


class _Injected:
    """The mooncake client with injected per-key status codes for scatter reads and upserts
    (a seam over `MooncakeBackend._store`): codes the real client returns only on faults
    this test cannot produce on demand (INTERNAL_ERROR, INVALID_PARAMS on a right-sized
    target, a replica going away)."""

    def __init__(self, real: object, get_codes: dict[str, int], put_code: int | None = None):
        self._real = real
        self.get_codes = get_codes
        self.put_code = put_code

    def batch_get_into_multi_buffers(
        self, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]:
        got: list[int] = self._real.batch_get_into_multi_buffers(names, ptrs, sizes)  # type: ignore[attr-defined]
        return [self.get_codes.get(name, n) for name, n in zip(names, got, strict=True)]

    def batch_upsert_from(self, names: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if self.put_code is not None:
            return [self.put_code] * len(names)
        return self._real.batch_upsert_from(names, ptrs, sizes)  # type: ignore[attr-defined, no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def _name(key: bytes) -> str:
    return f"hicache:{key.hex()}"


@pytest.mark.asyncio
async def test_injected_codes_are_mapped_per_key(backend: MooncakeBackend) -> None:
    store = GuardedStore(backend)
    keys = [bytes([i]) * 16 for i in range(5)]
    assert await store.put([(k, bytes([i]) * 8192) for i, k in enumerate(keys)]) == [True] * 5
    backend._store = _Injected(
        backend._store,
        {
            _name(keys[1]): -1,  # INTERNAL_ERROR: a failure for this key alone
            _name(keys[2]): -600,  # INVALID_PARAMS, yet the object has the targets' size
            _name(keys[3]): -712,  # REPLICA_IS_GONE: evicted mid-read, a miss
            _name(keys[4]): -800,  # TRANSFER_FAIL, the object has the targets' size
        },
    )
    targets = _registered_pages(backend, 5, 8192)
    fetched = await store.fetch_into(keys, targets)
    assert fetched.ok == [True, False, False, False, False]  # the good key is not lost
    assert fetched.answered_keys == [True, False, False, True, False]
    assert not fetched.answered
    assert store.stats.corrupt_dropped == 0  # nothing deleted on a transient code
    assert await backend.exists_many(keys) == [True] * 5
    assert store.stats.failures["get:key_failed"] == 3


@pytest.mark.asyncio
async def test_only_a_definite_other_size_deletes(backend: MooncakeBackend) -> None:
    store = GuardedStore(backend)
    longer, shorter = b"L" * 16, b"S" * 16
    assert await store.put([(longer, b"x" * 16384), (shorter, b"y" * 100)]) == [True, True]
    targets = _registered_pages(backend, 2, 8192)
    # the wheel says -600 (targets smaller) and -800 (larger); get_size confirms the size
    fetched = await store.fetch_into([longer, shorter], targets)
    assert fetched.ok == [False, False]
    assert fetched.answered_keys == [True, True]  # verified misses
    assert store.stats.corrupt_dropped == 2
    assert await backend.exists_many([longer, shorter]) == [False, False]


@pytest.mark.asyncio
async def test_a_full_store_refuses_a_put_without_tripping_the_breaker(
    backend: MooncakeBackend,
) -> None:
    store = GuardedStore(backend, failure_threshold=1)
    backend._store = _Injected(backend._store, {}, put_code=-200)  # NO_AVAILABLE_HANDLE
    assert await store.put([(b"f" * 16, b"v" * 100)]) == [False]
    assert store.breaker.state is BreakerState.CLOSED
    assert not store.stats.failures


@pytest.mark.asyncio
async def test_zero_copy_parts_put_round_trips_and_upserts(backend: MooncakeBackend) -> None:
    """Payloads in registered memory go out with no copy (`batch_put_from_multi_buffers`
    of [header, payload]); that call is a put, which keeps an existing key's old value, so
    the key is removed first: a second put with other bytes (and another size), right after
    a read took the key's lease, must still replace it."""
    store = GuardedStore(backend)
    pool = memoryview(bytearray(4 * 8192))
    backend.register_memory(pool)
    pages = [pool[i * 8192 : (i + 1) * 8192] for i in range(4)]
    for i, page in enumerate(pages):
        page[:] = bytes([i + 1]) * 8192
    keys = [bytes([0x40 + i]) * 16 for i in range(2)]
    calls: list[str] = []
    real = backend._store

    class _Spy:
        def batch_put_from_multi_buffers(self, *args: object) -> list[int]:
            calls.append("multi")
            return real.batch_put_from_multi_buffers(*args)  # type: ignore[no-any-return]

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    backend._store = _Spy()
    assert await store.put([(keys[0], pages[0]), (keys[1], [pages[1][:4096], pages[1][4096:]])])
    assert calls == ["multi"]
    host = _registered_pages(backend, 2, 8192)
    fetched = await store.fetch_into(keys, host)
    assert fetched.ok == [True, True]
    assert [bytes(t[0]) for t in host] == [bytes(pages[0]), bytes(pages[1])]
    # upsert: other bytes under a leased key, then another size
    assert await store.put([(keys[0], pages[2])]) == [True]
    (value,) = await store.get([keys[0]])
    assert value is not None
    assert bytes(value) == bytes(pages[2])
    assert await store.put([(keys[0], pages[3][:100])]) == [True]
    (value,) = await store.get([keys[0]])
    assert value is not None
    assert bytes(value) == bytes(pages[3][:100])
    assert calls == ["multi"] * 3


@pytest.mark.asyncio
async def test_zero_copy_put_refused_by_a_full_store_is_not_a_failure(
    backend: MooncakeBackend,
) -> None:
    """The zero-copy put removes the key first; when the store is then full (-200) the key
    gets one more try the copying way, and a store still full is "not stored", not a
    failure."""
    store = GuardedStore(backend, failure_threshold=1)
    pool = memoryview(bytearray(8192))
    backend.register_memory(pool)
    real = backend._store
    calls: list[str] = []

    class _Full:
        def batch_put_from_multi_buffers(self, names: list[str], *_: object) -> list[int]:
            calls.append("multi")
            return [-200] * len(names)  # NO_AVAILABLE_HANDLE

        def batch_upsert_from(self, names: list[str], *_: object) -> list[int]:
            calls.append("upsert")
            return [-200] * len(names)

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    backend._store = _Full()
    assert await store.put([(b"q" * 16, pool)]) == [False]
    assert calls == ["multi", "upsert"]
    assert store.breaker.state is BreakerState.CLOSED
    assert not store.stats.failures


@pytest.mark.asyncio
async def test_an_object_removed_for_a_put_the_full_store_refused_is_written_again(
    backend: MooncakeBackend,
) -> None:
    """remove-then-put must not lose the object when the put is refused: the copying upsert
    writes it (here the store has room again by then)."""
    store = GuardedStore(backend)
    pool = memoryview(bytearray(8192))
    backend.register_memory(pool)
    pool[:] = b"n" * 8192
    key = b"r" * 16
    assert await store.put([(key, pool)]) == [True]
    real = backend._store

    class _FullOnce:
        def batch_put_from_multi_buffers(self, names: list[str], *_: object) -> list[int]:
            return [-200] * len(names)

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    backend._store = _FullOnce()
    assert await store.put([(key, pool)]) == [True]
    backend._store = real
    (value,) = await store.get([key])
    assert value is not None
    assert bytes(value) == b"n" * 8192


@pytest.mark.asyncio
async def test_an_unregistered_head_scratch_removes_nothing_and_still_stores(
    backend: MooncakeBackend,
) -> None:
    """When the header scratch cannot be registered, the zero-copy path is not taken: no key
    is removed first, the object goes the copying way, and the unregistered scratch is not
    kept (the next put tries to register again)."""
    store = GuardedStore(backend)
    pool = memoryview(bytearray(8192))
    backend.register_memory(pool)
    pool[:] = b"u" * 8192
    key = b"s" * 16
    backend._scratches.pop("head", None)
    real = backend._store
    calls: list[str] = []

    class _NoRegister:
        def register_buffer(self, *_: object) -> int:
            return -1

        def batch_remove(self, names: list[str], force: bool) -> object:
            calls.append("remove")
            return real.batch_remove(names, force)  # type: ignore[attr-defined]

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    backend._store = _NoRegister()
    assert await store.put([(key, pool)]) == [True]
    assert await store.put([(key, pool)]) == [True]
    assert "remove" not in calls
    assert "head" not in backend._scratches
    backend._store = real
    (value,) = await store.get([key])
    assert value is not None
    assert bytes(value) == b"u" * 8192
