"""`RedisReads`: the reads both Redis backends make alike — GET, EXISTS and UNLINK of many
keys as one pipeline of single-key commands (on one server a pipeline on one connection; on a
cluster, redis-py's cluster pipeline groups them per node). Each backend gives `_pipeline`
(how its commands are sent) and `_name` (the object key); what a reply means is decided here
once: a WRONGTYPE reply to a GET is a miss (another type's value under our key: counted in
`objects_damaged`, the key unlinked), any other error reply fails the call."""

from __future__ import annotations

from collections.abc import Sequence

from hicache.storage.backend import StorageBackend
from hicache.storage.redis_wire import is_wrongtype, unavailable


class RedisReads(StorageBackend):
    where: str  # what messages show of the store (never its password)

    def _name(self, key: bytes) -> str:
        raise NotImplementedError

    async def _pipeline(
        self, commands: Sequence[tuple[str, tuple[str, ...]]], *, per_reply: bool = False
    ) -> list[object]:
        """The replies in order; `per_reply`: error replies come back as exceptions for the
        caller to judge, instead of failing the whole call."""
        raise NotImplementedError

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        names = [self._name(k) for k in keys]
        replies = await self._pipeline([("GET", (name,)) for name in names], per_reply=True)
        out: list[bytes | None] = []
        damaged = []
        for name, reply in zip(names, replies, strict=True):
            if isinstance(reply, BaseException):
                if not is_wrongtype(reply):
                    raise unavailable(self.where, reply, f"GET {name}")
                damaged.append(name)  # not a string: no object of ours, a miss
                out.append(None)
            else:
                out.append(reply if isinstance(reply, bytes) else None)
        if damaged:
            self.objects_damaged += len(damaged)
            await self._pipeline([("UNLINK", (name,)) for name in damaged])
        return out

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        replies = await self._pipeline([("EXISTS", (self._name(k),)) for k in keys])
        return [bool(r) for r in replies]

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        await self._pipeline([("UNLINK", (self._name(k),)) for k in keys])
