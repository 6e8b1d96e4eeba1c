"""`RedisBackend`: L3 on one Redis server (redis-py's asyncio client); a Redis Cluster is
`redis_cluster_backend`'s, with the key names, SET framing and error mapping of `redis_wire`.

Batches are pipelined (no transaction) over a connection pool. Keys are hash-tagged —
`<prefix>{<page key hex>}` — so a page's objects land on one shard of a cluster. Short
socket timeouts make a dead server fail fast; redis-py's errors are mapped to
`TierUnavailableError` here, and `GuardedStore` turns them into misses. Server-side eviction
(maxmemory-policy) bounds size.

Puts are vectored: each SET is framed by hand (RESP) around the object's parts — header, then
the payload straight from the caller's memory — and sent on one pooled connection of redis-py's
blocking client from a worker thread, so a page is never copied into an encoding buffer (on
this 2-vCPU machine that copy, not the socket, was what held puts at half the raw client's
speed). Reads stay on the asyncio client.

A value of another type under an object's key (a list, a hash: someone else's write into our
prefix) is a miss for that key, not a failure: GET answers it with a per-command WRONGTYPE
error, which is read per reply (the pipeline does not raise on it), counted in
`objects_damaged` and the key unlinked — a key under our prefix is ours. Any other error
reply still fails the call.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Sequence

import redis
import redis.asyncio as aioredis

from hicache.config.urls import redacted_url
from hicache.storage.backend import Buffer
from hicache.storage.redis_reads import RedisReads
from hicache.storage.redis_wire import (
    REDIS_FAILURES,
    object_name,
    set_head,
    unavailable,
)


class RedisBackend(RedisReads):
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
        self.where = redacted_url(url)  # what messages show: never the password
        self._stopped = threading.Event()  # stop_writes: puts on threads send no more objects
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
        return object_name(self.key_prefix, key)

    async def _pipeline(
        self, commands: Sequence[tuple[str, tuple[str, ...]]], *, per_reply: bool = False
    ) -> list[object]:
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for command, args in commands:
                    pipe.execute_command(command, *args)
                return list(await pipe.execute(raise_on_error=not per_reply))
        except REDIS_FAILURES as exc:
            raise unavailable(self.where, exc) from exc

    async def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        names = [self._name(k) for k, _ in items]

        def send() -> list[object]:
            try:
                pipe = self._sync.pipeline(transaction=False)
                for name, (_, data) in zip(names, items, strict=True):
                    pipe.set(name, data)
                return list(pipe.execute())
            except REDIS_FAILURES as exc:
                raise unavailable(self.where, exc) from exc

        replies = await asyncio.to_thread(send)
        return [bool(r) for r in replies]

    vectored_put = True

    def stop_writes(self) -> None:
        self._stopped.set()

    async def put_parts_many(self, items: Iterable[tuple[bytes, Sequence[Buffer]]]) -> list[bool]:
        def send() -> list[bool]:
            pool = self._sync.connection_pool
            conn = pool.get_connection()
            try:
                sent = skipped = 0
                # object by object, as the items are produced (a lazy producer computes each
                # header here, while redis-server drains the previous object from the socket)
                for key, parts in items:
                    if self._stopped.is_set():  # stop_writes: the rest are not stored
                        skipped += 1
                        continue
                    name = self._name(key).encode()
                    total = sum(memoryview(part).nbytes for part in parts)
                    head = set_head(name, total)
                    conn.send_packed_command([head, *parts, b"\r\n"])  # type: ignore[no-untyped-call]
                    sent += 1
                return [conn.read_response() == b"OK" for _ in range(sent)] + [False] * skipped
            except REDIS_FAILURES as exc:
                conn.disconnect()  # type: ignore[no-untyped-call]  # replies may be unread
                raise unavailable(self.where, exc) from exc
            finally:
                pool.release(conn)

        return await asyncio.to_thread(send)

    async def close(self) -> None:
        await self._client.aclose()
        await self._pool.disconnect()
        await asyncio.to_thread(self._sync.close)
