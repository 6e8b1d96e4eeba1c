"""The mooncake backend against a real mooncake_master on loopback (TCP, P2PHANDSHAKE):
round trips with upsert semantics, a master killed mid-run (misses, breaker opens, closes
after restart), and corruption detected by the object header."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from hicache.storage import BreakerState, CircuitBreaker, GuardedStore
from hicache.storage.local_servers import MooncakeMaster as MooncakeMasterType
from tests.storage.servers import MooncakeMaster

try:
    import mooncake.store  # noqa: F401

    from hicache.storage.mooncake_backend import MooncakeBackend
except ImportError:  # pragma: no cover - depends on the platform's wheel
    if os.environ.get("CI"):
        raise
    pytest.skip("mooncake-transfer-engine is not installed", allow_module_level=True)


@pytest.fixture
def master() -> Iterator[MooncakeMasterType]:
    srv = MooncakeMaster()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


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
    for _ in range(50):  # the client reconnects by itself; the half-open trial closes the breaker
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
    assert await store.fetch_into([items[0][0]], [targets[0]]) == ([False], True)
    assert store.stats.corrupt_dropped == 1
    assert await backend.exists_many([items[0][0]]) == [False]
    # the master down: the fetch did not get an answer, so nothing is dropped from an index
    master.stop()
    assert await store.fetch_into([items[1][0]], [targets[1]]) == ([False], False)


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
