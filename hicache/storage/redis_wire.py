"""What both Redis backends (`redis_backend`, one server; `redis_cluster_backend`, a
cluster) share: object key names (hash-tagged, so one page's objects share a cluster slot),
the hand-framed RESP header of a vectored SET, and the mapping of redis-py's errors to
`TierUnavailableError` naming where the store is (never its password)."""

from __future__ import annotations

from typing import TypeGuard

from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)

from hicache.errors import TierUnavailableError

# what a failed call to Redis can raise: redis-py's errors (the cluster's own tree does not
# derive from RedisError) and the socket's
REDIS_FAILURES = (RedisError, RedisClusterException, OSError)


def object_name(key_prefix: str, key: bytes) -> str:
    """`<prefix>{<key hex>}`: the braces make the key hex the cluster hash tag."""
    return f"{key_prefix}{{{key.hex()}}}"


def set_head(name: bytes, total_bytes: int) -> bytes:
    """RESP for `SET name <value>` up to the value itself: the value's `total_bytes` follow,
    then `\\r\\n`."""
    return b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, total_bytes)


# replies to a command that say "not here, not now" rather than "refused": MOVED and ASK
# (MovedError is an AskError), TRYAGAIN, CLUSTERDOWN and MASTERDOWN (MasterDownError is a
# ClusterDownError), LOADING (BusyLoadingError: a node loading its data set, as a restarted
# or newly promoted one may be)
FAILOVER_REPLIES = (AskError, TryAgainError, ClusterDownError, BusyLoadingError)


def is_failover(reply: object) -> TypeGuard[ResponseError | BusyLoadingError]:
    """A redirect or a failover-time error: worth sending again after the slot map is read
    again. Anything else an error reply says (OOM, READONLY, WRONGTYPE) is not."""
    return isinstance(reply, FAILOVER_REPLIES)


ASKING = b"*1\r\n$6\r\nASKING\r\n"  # before a command sent where an ASK redirect pointed


def unavailable(where: str, exc: BaseException, doing: str = "") -> TierUnavailableError:
    """The error a backend raises for `exc` (`doing`: the command, when one reply failed)."""
    prefix = f"redis at {where}: {doing}: " if doing else f"redis at {where}: "
    return TierUnavailableError(f"{prefix}{type(exc).__name__}: {exc}")


def is_wrongtype(reply: object) -> bool:
    """A per-command WRONGTYPE error: another type's value under the key (not ours: a miss)."""
    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")
