"""The L3 backend interface: batched put / get / exists / delete of opaque objects by key.

Backends store bytes and nothing else; the header and checksum (object_format), timeouts,
the circuit breaker and the miss-not-exception rule live in `GuardedStore`, so every backend
gets them alike. Methods are async; a blocking client runs in a worker thread.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence

Buffer = bytes | bytearray | memoryview

# what `get_parts_many` returns for a key instead of a byte count
MISSING = -1  # the backend answered: no such object (a miss the index may act on)
FAILED = -2  # the backend could not say for this key (a failure: the index keeps its entry)

# `get_parts_many`'s optional hook: (index of the first key, its and the next keys' counts),
# called on the backend's thread as soon as those objects are in their targets
Landed = Callable[[int, Sequence[int]], None]


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

    def stop_writes(self) -> None:
        """The shutdown drain's deadline passed: puts still running on a backend thread stop
        after the object they are writing (a cancelled await does not stop a thread, and the
        process would wait for it at exit). For good: only the drain calls it. Backends that
        write object by object on a thread of theirs override it."""
        return None

    # ---- zero-copy (optional): backends that move bytes to and from registered buffers ----

    vectored_put: bool = False  # put_parts_many is implemented
    chunked_put: bool = False  # a batch split in chunks costs no extra round trips
    vectored_get: bool = False  # get_parts_many is implemented
    streamed_get: bool = False  # get_parts_many calls `landed` as objects land

    async def get_parts_many(
        self,
        keys: Sequence[bytes],
        targets: Sequence[Sequence[memoryview]],
        *,
        landed: Landed | None = None,
    ) -> list[int]:
        """Read each key's object into its target buffers in order (scatter: the header into
        the first, the payload straight into the caller's memory); returns per key the bytes
        read, `MISSING` where the object is absent, or `FAILED` where the backend could not
        answer for that key. An object longer than its targets reads truncated; a backend that
        knows the object is another size may return 0 (the store then deletes it as corrupt).

        Contract (`GuardedStore` relies on it to know when the caller may reuse its pages):
        this coroutine completes — returns or raises — only once no thread it started can
        touch `targets` any more. The store never cancels it: on a timeout it stops waiting
        and awaits the call's completion in the background (`FetchedInto.settled`), so a
        backend must not wrap its threads in a timeout or cancellation of its own.

        `landed` (given only to a backend with `streamed_get`): called on the backend's
        thread, in key order, with the counts of objects once they are in their targets (and
        will not be written again), so the store verifies each while it is still in the CPU's
        cache; a key it was not called for is verified after the call returns."""
        raise NotImplementedError(f"{self.name} has no vectored reads")

    async def put_parts_many(self, items: Iterable[tuple[bytes, Sequence[Buffer]]]) -> list[bool]:
        """Like `put_many`, each object given as parts to write back to back (header, then
        the payload straight from the caller's memory): no copy into an encoding buffer.
        `items` may be produced lazily: consume it once, in order."""
        raise NotImplementedError(f"{self.name} has no vectored writes")

    def register_memory(self, view: memoryview) -> None:
        """Memory the caller will read into or write from (the host tier's pools): a backend
        that moves bytes by DMA registers it; others ignore it."""
        return None

    def alloc_buffer(self, nbytes: int) -> memoryview:
        """A writable buffer the caller encodes objects into before `put_many` (a backend
        with registered memory returns memory it can send from without a copy)."""
        return memoryview(bytearray(nbytes))

    # things met where an object should be that are not one (a directory or FIFO in place of
    # a file, a Redis list under an object's key): each read as a miss for its key, counted
    # here, never a failure for the breaker
    objects_damaged: int = 0

    def damaged(self) -> int:
        """`objects_damaged` so far (a wrapper answers for the backend it wraps)."""
        return self.objects_damaged

    async def close(self) -> None:
        return None
