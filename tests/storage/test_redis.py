"""The redis backend against a real redis-server on loopback: round trips, a server killed
mid-run (misses, breaker opens, closes after restart), and corruption inside Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.storage.servers import REDIS_CLIENT, RedisServer

pytest.importorskip("redis", reason=REDIS_CLIENT)

import pytest_asyncio
import redis.asyncio as aioredis

from hicache.storage import BreakerState, CircuitBreaker, GuardedStore
from hicache.storage.redis_backend import RedisBackend
from hicache.testing.local_servers import RedisServer as RedisServerType


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServerType]:
    srv = RedisServer(tmp_path)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest_asyncio.fixture
async def backend(server: RedisServerType) -> AsyncIterator[RedisBackend]:
    b = RedisBackend(server.url, socket_timeout_s=0.5)
    yield b
    await b.close()


@pytest.mark.asyncio
async def test_round_trip_pipelined(backend: RedisBackend) -> None:
    store = GuardedStore(backend)
    items = [(bytes([i]) * 16, bytes([i]) * (1 << 16)) for i in range(32)]
    assert await store.put(items) == [True] * 32
    got = await store.get([k for k, _ in items] + [b"\xff" * 16])
    assert [bytes(v) if v is not None else None for v in got] == [d for _, d in items] + [None]
    assert await store.exists([items[0][0], b"\xee" * 16]) == [True, False]
    await backend.delete_many([items[0][0]])
    assert await store.exists([items[0][0]]) == [False]


@pytest.mark.asyncio
async def test_server_killed_mid_run_then_restarted(
    server: RedisServerType, backend: RedisBackend
) -> None:
    now = [0.0]
    store = GuardedStore(
        backend,
        breaker=CircuitBreaker(2, reset_after_s=1.0, clock=lambda: now[0]),
        base_timeout_s=1.0,
    )
    key = b"k" * 16
    assert await store.put([(key, b"v" * 1000)]) == [True]
    server.stop()  # the server dies
    assert await store.get([key]) == [None]  # no exception reaches the caller
    assert await store.put([(b"j" * 16, b"w")]) == [False]
    assert store.breaker.state is BreakerState.OPEN
    assert sum(store.stats.failures.values()) == 2
    server.start()  # back (empty: the test server keeps no data across a kill)
    now[0] = 1.0
    assert await store.put([(key, b"v2" * 10)]) == [True]  # the half-open trial succeeds
    assert store.breaker.state is BreakerState.CLOSED
    got = await store.get([key])
    assert got[0] is not None
    assert bytes(got[0]) == b"v2" * 10


@pytest.mark.asyncio
async def test_corruption_inside_redis_is_detected_dropped_and_counted(
    server: RedisServerType, backend: RedisBackend
) -> None:
    store = GuardedStore(backend)
    key = b"c" * 16
    assert await store.put([(key, b"payload" * 100)]) == [True]
    raw = aioredis.Redis.from_url(server.url)
    name = f"hicache:{{{key.hex()}}}"
    data = bytearray(await raw.get(name))
    data[-10] ^= 0xFF
    await raw.set(name, bytes(data))
    assert await store.get([key]) == [None]
    assert store.stats.corrupt_dropped == 1
    assert await raw.exists(name) == 0  # deleted: never served again
    await raw.aclose()
