"""`RedisBackend`: L3 on a Redis server or Redis Cluster (redis-py's asyncio client).

Batches are pipelined (no transaction) over a connection pool. Keys are hash-tagged —
`<prefix>{<page key hex>}` — so a page's objects land on one shard of a cluster; pipelines of
single-key commands (not MGET) keep batches valid across slots. Short socket timeouts make a
dead server fail fast; redis-py's errors are mapped to `TierUnavailableError` here, and
`GuardedStore` turns them into misses. Server-side eviction (maxmemory-policy) bounds size.

Puts are vectored: each SET is framed by hand (RESP) around the object's parts — header, then
the payload straight from the caller's memory — and sent on one pooled connection of redis-py's
blocking client from a worker thread, so a page is never copied into an encoding buffer (on
this 2-vCPU machine that copy, not the socket, was what held puts at half the raw client's
speed). Reads stay on the asyncio client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import redis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from hicache.errors import TierUnavailableError
from hicache.storage.backend import Buffer, StorageBackend


class RedisBackend(StorageBackend):
    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "hicache:",
        max_connections: int = 16,
        socket_timeout_s: float = 2.0,
    ):
        self.url = url
        self.key_prefix = key_prefix
        self._pool = aioredis.ConnectionPool.from_url(
            url,
            max_connections=max_connections,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
        )
        self._client = aioredis.Redis(connection_pool=self._pool)
        self._sync = redis.Redis(
            connection_pool=redis.ConnectionPool.from_url(
                url,
                max_connections=max_connections,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
            )
        )

    def _name(self, key: bytes) -> str:
        return f"{self.key_prefix}{{{key.hex()}}}"

    async def _pipeline(self, commands: Sequence[tuple[str, tuple[object, ...]]]) -> list[object]:
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for command, args in commands:
                    getattr(pipe, command)(*args)
                return list(await pipe.execute())
        except (RedisError, OSError) as exc:
            raise TierUnavailableError(f"redis at {self.url}: {type(exc).__name__}: {exc}") from exc

    async def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        names = [self._name(k) for k, _ in items]

        def send() -> list[object]:
            try:
                pipe = self._sync.pipeline(transaction=False)
                for name, (_, data) in zip(names, items, strict=True):
                    pipe.set(name, data)
                return list(pipe.execute())
            except (RedisError, OSError) as exc:
                raise TierUnavailableError(
                    f"redis at {self.url}: {type(exc).__name__}: {exc}"
                ) from exc

        replies = await asyncio.to_thread(send)
        return [bool(r) for r in replies]

    vectored_put = True

    async def put_parts_many(self, items: Iterable[tuple[bytes, Sequence[Buffer]]]) -> list[bool]:
        def send() -> list[bool]:
            pool = self._sync.connection_pool
            conn = pool.get_connection()
            try:
                sent = 0
                # object by object, as the items are produced (a lazy producer computes each
                # header here, while redis-server drains the previous object from the socket)
                for key, parts in items:
                    name = self._name(key).encode()
                    total = sum(memoryview(part).nbytes for part in parts)
                    head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, total)
                    conn.send_packed_command([head, *parts, b"\r\n"])  # type: ignore[no-untyped-call]
                    sent += 1
                return [conn.read_response() == b"OK" for _ in range(sent)]
            except (RedisError, OSError) as exc:
                conn.disconnect()  # type: ignore[no-untyped-call]  # replies may be unread
                raise TierUnavailableError(
                    f"redis at {self.url}: {type(exc).__name__}: {exc}"
                ) from exc
            finally:
                pool.release(conn)

        return await asyncio.to_thread(send)

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        replies = await self._pipeline([("get", (self._name(k),)) for k in keys])
        return [r if isinstance(r, bytes) else None for r in replies]

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        replies = await self._pipeline([("exists", (self._name(k),)) for k in keys])
        return [bool(r) for r in replies]

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        await self._pipeline([("unlink", (self._name(k),)) for k in keys])

    async def close(self) -> None:
        await self._client.aclose()
        await self._pool.disconnect()
        await asyncio.to_thread(self._sync.close)
