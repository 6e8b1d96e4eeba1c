"""`ScatterReads`: `GuardedStore.fetch_into` on a backend that reads straight into caller
memory (`vectored_get`: file `readv`, Mooncake's scatter read) — each object's header into
a head arena the backend allocates (registered memory) and its payload into the caller's
target buffers, chunk by chunk (about `chunk_bytes` each), verified there.

    result = await reads.read(keys, targets, sizes, outstanding, chunk_bytes)   # FetchedInto

Chunk k+1's read starts before chunk k is awaited (while the breaker is closed), so the
backend's thread never waits for the loop; a streaming backend (`streamed_get`) has each
object verified on its own thread as it lands, the rest of a chunk is verified on a worker
thread while the next chunk is read. Every call goes through `GuardedCalls.launch` /
`settle_call`: a read that times out is never cancelled, and stays tracked in `outstanding`
(the handle's `settled`) until its thread ends; past the store's wait, a `Gate` keeps its
verdicts uncounted. Reads are one at a time (the head arena is shared); an arena a read may
still write is dropped for a fresh one. The whole lifecycle is in `guarded.py`'s docstring.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from hicache.storage import object_format
from hicache.storage.backend import FAILED, Landed, StorageBackend
from hicache.storage.batches import Gate, runs, verify_all
from hicache.storage.breaker import BreakerState
from hicache.storage.calls import GuardedCalls
from hicache.storage.fetch_handles import FetchedInto, Outstanding

if TYPE_CHECKING:
    from hicache.storage.guarded import StoreStats


class ScatterReads:
    def __init__(self, backend: StorageBackend, calls: GuardedCalls, stats: StoreStats):
        self.backend = backend
        self.calls = calls
        self.stats = stats
        self._head_arena: memoryview | None = None
        self._get_lock = asyncio.Lock()

    async def read(
        self,
        keys: list[bytes],
        targets: list[list[memoryview]],
        sizes: list[int],
        outstanding: Outstanding,
        chunk_bytes: int,
    ) -> FetchedInto:
        """Read, verify and count the objects into `targets` (`sizes`: each one's payload
        bytes), in chunks of about `chunk_bytes`; closes `outstanding` once nothing more
        starts."""
        self.stats.gets += len(keys)
        started = time.perf_counter()
        ok: list[bool] = [False] * len(keys)
        answered_keys: list[bool] = [False] * len(keys)
        corrupt: list[bytes] = []
        async with self._get_lock:  # the headers land in the store's (registered) arena
            try:
                timed_out = await self._scatter(
                    keys, targets, sizes, ok, answered_keys, corrupt, outstanding, chunk_bytes
                )
            finally:
                if not outstanding.idle:  # a read still running may write the head arena
                    self._head_arena = None
        if corrupt:
            self.stats.corrupt_dropped += len(corrupt)
            await self.calls.call("delete", 0, lambda: self.backend.delete_many(corrupt))
        hits = sum(ok)
        self.stats.hits += hits
        self.stats.misses += len(keys) - hits
        self.stats.get_bytes += sum(size for size, good in zip(sizes, ok, strict=True) if good)
        self.stats.get_seconds += time.perf_counter() - started
        outstanding.close()
        return FetchedInto(ok, all(answered_keys), answered_keys, timed_out, outstanding.settled)

    async def _scatter(
        self,
        keys: list[bytes],
        targets: list[list[memoryview]],
        sizes: list[int],
        ok: list[bool],
        answered_keys: list[bool],
        corrupt: list[bytes],
        outstanding: Outstanding,
        chunk_bytes: int,
    ) -> bool:
        """Read chunk by chunk, verifying chunk k on a worker thread while chunk k+1 is read
        (readv and xxhash both release the GIL). Fills `ok`, `answered_keys` and `corrupt`;
        returns whether a read timed out. Stops at the first chunk that fails: its reads
        (and every later chunk) are never verified."""
        head_sizes = [object_format.HEADER_BYTES + len(k) for k in keys]
        if self._head_arena is None or self._head_arena.nbytes < sum(head_sizes):
            self._head_arena = self.backend.alloc_buffer(max(sum(head_sizes), 4096))
        heads, offset = [], 0
        for size in head_sizes:
            heads.append(self._head_arena[offset : offset + size])
            offset += size
        verifying: asyncio.Future[list[bool | None]] | None = None
        verifying_chunk: list[int] = []
        timed_out = False
        streamed = self.backend.streamed_get
        # A streaming backend has each object verified on its thread as it lands (while
        # still in the CPU's cache); what it did not report is verified after the call, on a
        # worker thread while the next chunk is read. The next chunk's read is started before
        # this one is awaited, so the backend's thread never waits for the loop between two.
        todo = runs(sizes, chunk_bytes)
        started: list[tuple[asyncio.Future[list[int]] | None, Gate, dict[int, bool | None]]] = []

        def launch(chunk: list[int]) -> None:
            gate = Gate()
            early: dict[int, bool | None] = {}
            landed = self._verifier(chunk, keys, heads, targets, gate, early) if streamed else None
            scatter = [[heads[i], *targets[i]] for i in chunk]
            reader = self._scatter_reader([keys[i] for i in chunk], scatter, landed)
            started.append((self.calls.launch(reader, outstanding), gate, early))

        for k, chunk in enumerate(todo):
            if len(started) == k:
                launch(chunk)
            # the next chunk only while the breaker is closed: half-open lets one trial call
            # through, and a chunk launched beside it would be refused though the trial
            # succeeds (the first fetch after an outage would lose all but its first chunk)
            if (
                len(started) == k + 1 < len(todo)
                and self.calls.breaker.state is BreakerState.CLOSED
            ):
                launch(todo[k + 1])
            call, gate, early = started[k]
            read: list[int] | None = None
            why: str | None = "open"
            if call is not None:
                settled = await self.calls.settle_call("get", sum(sizes[i] for i in chunk), call)
                read, why = settled
            gate.close()  # a late read's verdicts are never counted
            if verifying is not None:
                # shielded: a cancelled caller leaves the thread tracked, not orphaned
                outcomes = await asyncio.shield(verifying)
                self._settle(outcomes, verifying_chunk, keys, ok, answered_keys, corrupt)
                verifying = None
            if read is None:
                timed_out = why == "timeout"
                for _, later, _ in started[k + 1 :]:
                    later.close()  # already started: left running, tracked, never counted
                break
            failed = [i for i, n in zip(chunk, read, strict=True) if n == FAILED]
            if failed:  # the backend could not say for these keys: a failure, not a miss
                self.calls.failed(
                    "get:key_failed", note=f"{len(failed)} of {len(chunk)} keys", count=len(failed)
                )
            else:
                self.calls.breaker.success()
            good = [(i, n) for i, n in zip(chunk, read, strict=True) if n != FAILED]
            settled_now = [i for i, _ in good if i in early]
            self._settle(
                [early[i] for i in settled_now], settled_now, keys, ok, answered_keys, corrupt
            )
            rest = [(i, n) for i, n in good if i not in early]
            if rest:
                jobs = [(keys[i], heads[i], targets[i], n) for i, n in rest]
                verifying = asyncio.ensure_future(asyncio.to_thread(verify_all, jobs))
                outstanding.track(verifying)
                verifying_chunk = [i for i, _ in rest]
        if verifying is not None:
            outcomes = await asyncio.shield(verifying)
            self._settle(outcomes, verifying_chunk, keys, ok, answered_keys, corrupt)
        return timed_out

    @staticmethod
    def _verifier(
        chunk: list[int],
        keys: list[bytes],
        heads: list[memoryview],
        targets: list[list[memoryview]],
        gate: Gate,
        early: dict[int, bool | None],
    ) -> Landed:
        """The `landed` hook for one chunk: verifies each reported object on the backend's
        thread and records its verdict in `early` while the store still waits (`gate`)."""

        def landed(start: int, counts: Sequence[int]) -> None:
            for offset, n in enumerate(counts):
                i = chunk[start + offset]
                if n == FAILED:
                    continue
                (outcome,) = verify_all([(keys[i], heads[i], targets[i], n)])
                with gate.lock:
                    if not gate.open:
                        return
                    early[i] = outcome

        return landed

    def _scatter_reader(
        self, keys: list[bytes], scatter: list[list[memoryview]], landed: Landed | None = None
    ) -> Callable[[], Awaitable[list[int]]]:
        if landed is None:
            return lambda: self.backend.get_parts_many(keys, scatter)
        return lambda: self.backend.get_parts_many(keys, scatter, landed=landed)

    @staticmethod
    def _settle(
        outcomes: list[bool | None],
        chunk: list[int],
        keys: Sequence[bytes],
        ok: list[bool],
        answered_keys: list[bool],
        corrupt: list[bytes],
    ) -> None:
        """Record a verified chunk: True valid, False corrupt (to delete), None absent."""
        for i, outcome in zip(chunk, outcomes, strict=True):
            ok[i] = outcome is True
            answered_keys[i] = True
            if outcome is False:
                corrupt.append(keys[i])
