"""`RedisClusterBackend`: L3 on a Redis Cluster, with `RedisBackend`'s semantics.

Lifecycle: built from a `redis+cluster://` URL (or a `redis://` one with `cluster: true`; one
seed suffices, a comma-separated list in the netloc adds more); nothing connects until the
first call, so a cluster that is down at start-up is the breaker's to find, not a start-up
error. The first put builds redis-py's blocking cluster client (which reads the slot map from
a seed), the first read its asyncio client; `close()` closes both, and from then on every
call fails as `TierUnavailableError` ("closed") instead of building a client nothing closes.

Puts are vectored like `RedisBackend`'s: each SET is framed by hand (`redis_wire.set_head`)
around the object's parts and sent on a connection to the master that owns its key's slot
(keys are hash-tagged `<prefix>{<key hex>}`), one connection per master for the whole batch,
objects streamed as they are produced; then each master's replies are read in order. A
MOVED, ASK, TRYAGAIN, CLUSTERDOWN, MASTERDOWN or LOADING reply (`redis_wire.is_failover`), or
a master that cannot be reached, sends those objects to a second round after the slot map is
read again (one re-read at a time; ASK: to the node it names, behind ASKING; none after
`stop_writes`), counted in `objects_resent`; what fails in that round fails the whole call as
`TierUnavailableError`, which `GuardedStore`'s breaker counts. Any other error reply (OOM,
READONLY) fails the call at once. A connection goes back to its pool only with every reply
sent on it read; any other is disconnected first (a failed call leaves no stale reply for the
next one to read as its own). During a failover (a master dead, its replica not yet
promoted) calls fail that way, and succeed again once the cluster has promoted the replica.

Reads, exists and deletes go through redis-py's asyncio cluster pipeline, which groups the
commands per node, runs the nodes' pipelines concurrently and follows redirects. A WRONGTYPE
reply to a GET is a miss for that key, counted in `objects_damaged`, and the key unlinked;
any other error reply fails the call.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis.asyncio.cluster as aiocluster
import redis.cluster
from redis.crc import key_slot
from redis.exceptions import AskError, BusyLoadingError, MovedError, ResponseError

from hicache.config.urls import cluster_seeds, redacted_url
from hicache.errors import TierUnavailableError
from hicache.storage.backend import Buffer
from hicache.storage.redis_reads import RedisReads
from hicache.storage.redis_wire import (
    ASKING,
    REDIS_FAILURES,
    is_failover,
    object_name,
    set_head,
    unavailable,
)


@dataclass
class _Put:
    index: int  # in the call's items
    name: bytes
    parts: Sequence[Buffer]
    ask: tuple[str, int] | None = None  # an ASK redirect's node: send there, behind ASKING


class RedisClusterBackend(RedisReads):
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
        self.key_prefix = key_prefix
        self._single_url, self.seeds = cluster_seeds(url)
        self._options: dict[str, object] = {
            "max_connections": max_connections,
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": socket_timeout_s,
        }
        self._stopped = threading.Event()  # stop_writes: puts on threads send no more objects
        self._lock = threading.Lock()  # builds the blocking client once; guards `_closed`
        self._refresh_lock = threading.Lock()  # one slot-map re-read at a time
        self._closed = False  # close() was called: no client is built again
        self._sync: redis.cluster.RedisCluster | None = None
        self._async: aiocluster.RedisCluster | None = None
        self.objects_resent = 0  # objects sent in a second round (redirected, node failed)

    def _name(self, key: bytes) -> str:
        return object_name(self.key_prefix, key)

    # ---- clients, built on first use ----

    def _closed_error(self) -> TierUnavailableError:
        return TierUnavailableError(f"redis at {self.where}: closed")

    def _sync_client(self) -> redis.cluster.RedisCluster:
        with self._lock:
            if self._closed:  # a put thread started just before close(): nothing would close
                raise self._closed_error()  # a client built now
            if self._sync is None:
                try:
                    self._sync = redis.cluster.RedisCluster(
                        url=self._single_url,
                        startup_nodes=[
                            redis.cluster.ClusterNode(h, p)  # type: ignore[no-untyped-call]
                            for h, p in self.seeds[1:]
                        ],
                        **self._options,  # type: ignore[arg-type]
                    )
                except REDIS_FAILURES as exc:
                    raise unavailable(self.where, exc) from exc
            return self._sync

    def _async_client(self) -> aiocluster.RedisCluster:
        if self._closed:
            raise self._closed_error()
        if self._async is None:
            self._async = aiocluster.RedisCluster.from_url(
                self._single_url,
                startup_nodes=[aiocluster.ClusterNode(h, p) for h, p in self.seeds[1:]],
                **self._options,
            )
        return self._async

    # ---- puts ----

    vectored_put = True

    def stop_writes(self) -> None:
        self._stopped.set()

    async def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        return await self.put_parts_many([(key, [data]) for key, data in items])

    async def put_parts_many(self, items: Iterable[tuple[bytes, Sequence[Buffer]]]) -> list[bool]:
        return await asyncio.to_thread(self._put_parts, items)

    def _put_parts(self, items: Iterable[tuple[bytes, Sequence[Buffer]]]) -> list[bool]:
        cluster = self._sync_client()
        stored: list[bool] = []

        def produced() -> Iterable[_Put]:
            # object by object, as the items are produced (a lazy producer computes each
            # header here, while the masters drain the previous objects from their sockets)
            for key, parts in items:
                if self._closed:  # close() ran meanwhile: this call's connections go too
                    raise self._closed_error()
                stored.append(False)
                if not self._stopped.is_set():  # stop_writes: the rest are not stored
                    yield _Put(len(stored) - 1, self._name(key).encode(), parts)

        again = self._send_round(cluster, produced(), stored)
        if again and self._closed:
            raise self._closed_error()
        if again and not self._stopped.is_set():  # stop_writes: no second round either
            with self._refresh_lock:  # one re-read at a time: two put threads may share it
                try:
                    cluster.nodes_manager.initialize()  # the slot map, read again
                except REDIS_FAILURES as exc:
                    raise unavailable(self.where, exc) from exc
                self.objects_resent += len(again)  # under the lock: threads share the count
            if self._send_round(cluster, again, stored, last=True):
                raise AssertionError("the last round returns nothing to send again")
        return stored

    def _send_round(
        self,
        cluster: redis.cluster.RedisCluster,
        puts: Iterable[_Put],
        stored: list[bool],
        *,
        last: bool = False,
    ) -> list[_Put]:
        """Send `puts`, each to its slot's master, and read the replies; marks `stored`.
        Returns the puts to send again (redirected, or their node unreachable); in the `last`
        round those fail the call instead.

        A connection goes back to its pool as it is only when every reply sent on it was read
        (`in_step`); any other (an error reply, a node that failed, or any exception before
        its replies were read) is disconnected first, so no later call reads its replies."""
        conns: dict[str, tuple[redis.Redis, object]] = {}  # node name -> (client, connection)
        sent: dict[str, list[_Put]] = {}
        failed: dict[str, BaseException] = {}  # node name -> why it could not be reached
        in_step: set[str] = set()  # nodes whose connection has every reply read
        again: list[_Put] = []
        try:
            for put in puts:
                try:
                    node = self._node_for(cluster, put)
                except REDIS_FAILURES as exc:
                    if last:
                        raise unavailable(self.where, exc) from exc
                    again.append(put)
                    continue
                if node.name in failed:
                    again.append(put)
                    continue
                try:
                    if node.name not in conns:
                        client = cluster.get_redis_connection(node)
                        conns[node.name] = (client, client.connection_pool.get_connection())
                    conn = conns[node.name][1]
                    total = sum(memoryview(part).nbytes for part in put.parts)
                    head = set_head(put.name, total)
                    prefix = [ASKING] if put.ask is not None else []
                    conn.send_packed_command([*prefix, head, *put.parts, b"\r\n"])  # type: ignore[attr-defined]
                    sent.setdefault(node.name, []).append(put)
                except REDIS_FAILURES as exc:
                    failed[node.name] = exc
                    again.append(put)
            for node_name, node_puts in sent.items():
                if node_name in failed:
                    again.extend(node_puts)  # unread replies: whether they were stored is moot
                    continue
                conn = conns[node_name][1]
                resolved = 0  # of node_puts, whose replies were read
                try:
                    for put in node_puts:
                        if put.ask is not None:
                            self._reply(conn)  # ASKING's +OK
                        reply = self._reply(conn)
                        if is_failover(reply):
                            again.append(self._redirected(put, reply))
                        elif isinstance(reply, ResponseError):
                            raise unavailable(self.where, reply, f"SET {put.name.decode()}")
                        else:
                            stored[put.index] = reply == b"OK"
                        resolved += 1
                    in_step.add(node_name)
                except REDIS_FAILURES as exc:
                    failed[node_name] = exc
                    again.extend(node_puts[resolved:])
        finally:
            for node_name, (client, conn) in conns.items():
                if node_name not in in_step:
                    conn.disconnect()  # type: ignore[attr-defined]  # replies may be unread
                client.connection_pool.release(conn)  # type: ignore[arg-type]
        if again and last:
            why = "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in failed.items())
            raise TierUnavailableError(
                f"redis at {self.where}: {len(again)} objects not stored after the slot map "
                f"was read again ({why or 'redirected twice'})"
            )
        return again

    @staticmethod
    def _node_for(cluster: redis.cluster.RedisCluster, put: _Put) -> redis.cluster.ClusterNode:
        if put.ask is not None:
            host, port = put.ask
            node = cluster.get_node(host=host, port=port)  # type: ignore[no-untyped-call]
            if not isinstance(node, redis.cluster.ClusterNode):
                raise TierUnavailableError(f"ASK redirect to {host}:{port}, a node not known")
            return node
        return cluster.nodes_manager.get_node_from_slot(key_slot(put.name))

    @staticmethod
    def _reply(conn: object) -> object:
        """One reply; an error reply is returned (the connection stays in step), not raised:
        LOADING too, which redis-py raises as a connection error after reading the whole
        line (read without its disconnect: what fails here is disconnected by the caller)."""
        try:
            return conn.read_response(disconnect_on_error=False)  # type: ignore[attr-defined]
        except (ResponseError, BusyLoadingError) as exc:
            return exc

    @staticmethod
    def _redirected(put: _Put, reply: BaseException) -> _Put:
        ask = None
        if isinstance(reply, AskError) and not isinstance(reply, MovedError):
            ask = (reply.host, int(reply.port))
        return _Put(put.index, put.name, put.parts, ask)

    # ---- reads, exists, deletes ----

    async def _pipeline(
        self, commands: Sequence[tuple[str, tuple[str, ...]]], *, per_reply: bool = False
    ) -> list[object]:
        """The replies in order; `per_reply`: error replies come back as exceptions for the
        caller to judge, instead of failing the whole call."""
        try:
            async with self._async_client().pipeline() as pipe:
                for command, args in commands:  # queued as plain commands: the pipeline's
                    pipe.execute_command(command, *args)  # own unlink is not one to queue
                return list(await pipe.execute(raise_on_error=not per_reply))
        except REDIS_FAILURES as exc:
            raise unavailable(self.where, exc) from exc

    async def close(self) -> None:
        with self._lock:
            self._closed = True
            sync, self._sync = self._sync, None
        aio, self._async = self._async, None
        if aio is not None:
            await aio.aclose()
        if sync is not None:
            await asyncio.to_thread(sync.close)
