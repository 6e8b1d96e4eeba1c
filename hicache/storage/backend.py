"""The L3 backend interface: batched put / get / exists / delete of opaque objects by key.

Backends store bytes and nothing else; the header and checksum (object_format), timeouts,
the circuit breaker and the miss-not-exception rule live in `GuardedStore`, so every backend
gets them alike. Methods are async; a blocking client runs in a worker thread.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

Buffer = bytes | bytearray | memoryview


class StorageBackend(abc.ABC):
    name: str

    @abc.abstractmethod
    async def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        """Store each (key, object); True where it is durably stored. The object buffers are
        only valid until this returns (the caller reuses them): copy what must outlive it."""

    @abc.abstractmethod
    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's object, or None where it is absent."""

    @abc.abstractmethod
    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    @abc.abstractmethod
    async def delete_many(self, keys: Sequence[bytes]) -> None: ...

    async def close(self) -> None:
        return None
