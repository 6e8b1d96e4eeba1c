"""`GuardedStore`: the L3 tier as the rest of hicache sees it — misses, never exceptions.

Every object is written with a header and checksum and verified on read; a corrupt object is
deleted, counted and reported as a miss. Each call has a timeout derived from its bytes
(`base_timeout_s + bytes / min_bandwidth_bytes_per_s`). A `CircuitBreaker` counts failures:
after `failure_threshold` in a row it opens and calls return misses at once without touching
the backend; after `reset_after_s` the next call is a trial (half-open) that closes the
breaker on success or re-opens it on failure (`breaker.py`). Backend-native errors are mapped to
`TierUnavailableError` and counted by reason; none propagate.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from hicache.errors import ObjectCorruptError
from hicache.storage import object_format
from hicache.storage.backend import Buffer, StorageBackend
from hicache.storage.breaker import BreakerState, CircuitBreaker
from hicache.storage.object_format import Parts, payload_bytes

T = TypeVar("T")


PROBE_KEY = b"hicache-breaker-probe"


@dataclass(frozen=True, slots=True)
class Fetched:
    values: list[memoryview | None]
    answered: bool  # False: the backend failed or the breaker is open; the Nones are unknown


@dataclass
class StoreStats:
    puts: int = 0
    stored: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt_dropped: int = 0
    skipped_open: int = 0
    put_bytes: int = 0  # payload bytes acknowledged stored
    put_seconds: float = 0.0
    get_bytes: int = 0  # payload bytes returned verified
    get_seconds: float = 0.0
    failures: Counter[str] = field(default_factory=Counter)


def _runs(sizes: Sequence[int], chunk_bytes: int) -> list[list[int]]:
    """Consecutive runs of indices of about `chunk_bytes` bytes (at least one each)."""
    runs: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        if runs[-1] and total + size > chunk_bytes:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += size
    return runs if runs[0] else []


def _chunks(
    items: Sequence[tuple[bytes, Parts]], sizes: Sequence[int], chunk_bytes: int
) -> list[list[tuple[tuple[bytes, Parts], int]]]:
    """`_runs` of items, each with its size."""
    return [[(items[i], sizes[i]) for i in run] for run in _runs(sizes, chunk_bytes)]


def _encode(
    chunk: list[tuple[tuple[bytes, Parts], int]], arena: memoryview, offset: int
) -> list[tuple[bytes, memoryview]]:
    encoded = []
    for (key, payload), size in chunk:
        object_format.encode_into(arena[offset : offset + size], key, payload)
        encoded.append((key, arena[offset : offset + size]))
        offset += size
    return encoded


def _headers(
    chunk: list[tuple[tuple[bytes, Parts], int]],
) -> list[tuple[bytes, Sequence[Buffer]]]:
    return [(key, _with_header(key, payload)) for (key, payload), _ in chunk]


def _lazy_headers(
    items: Sequence[tuple[bytes, Parts]],
) -> Iterator[tuple[bytes, Sequence[Buffer]]]:
    for key, payload in items:
        yield key, _with_header(key, payload)


def _with_header(key: bytes, payload: Parts) -> list[Buffer]:
    parts = object_format.parts_of(payload)
    return [object_format.header(key, parts), *parts]


def _verify_all(
    jobs: list[tuple[bytes, memoryview, list[memoryview], int]],
) -> list[bool | None]:
    """Per object: True verified, False present but corrupt, None absent."""
    out: list[bool | None] = []
    for key, head, target, n in jobs:
        if n < 0:
            out.append(None)
            continue
        try:
            object_format.verify_parts(key, head, target, n)
            out.append(True)
        except ObjectCorruptError:
            out.append(False)
    return out


async def _collect(
    in_flight: tuple[asyncio.Future[list[bool] | None], int], result: list[bool]
) -> bool:
    """Append a sent chunk's outcomes to `result`; True when the call failed."""
    future, count = in_flight
    outcome = await future
    result += outcome if outcome is not None else [False] * count
    return outcome is None


class GuardedStore:
    def __init__(
        self,
        backend: StorageBackend,
        *,
        breaker: CircuitBreaker | None = None,
        base_timeout_s: float = 1.0,
        min_bandwidth_bytes_per_s: float = 50e6,
        chunk_bytes: int = 16 << 20,
    ):
        self.backend = backend
        self.breaker = breaker or CircuitBreaker()
        self.base_timeout_s = base_timeout_s
        self.min_bandwidth = min_bandwidth_bytes_per_s
        self.stats = StoreStats()
        self.chunk_bytes = chunk_bytes
        self._arena: memoryview | None = None
        self._arena_lock = asyncio.Lock()
        self._head_arena: memoryview | None = None
        self._get_lock = asyncio.Lock()

    def _timeout(self, nbytes: int) -> float:
        return self.base_timeout_s + nbytes / self.min_bandwidth

    async def _call(
        self, what: str, nbytes: int, coro_factory: Callable[[], Awaitable[T]]
    ) -> T | None:
        """Run one backend call under the breaker and a timeout; None means 'treat as miss'."""
        if not self.breaker.allow():
            self.stats.skipped_open += 1
            return None
        try:
            result = await asyncio.wait_for(coro_factory(), self._timeout(nbytes))
        except TimeoutError:
            self.stats.failures[f"{what}:timeout"] += 1
            self.breaker.failure()
            return None
        except Exception as exc:  # every backend error becomes a miss; counted by reason
            self.stats.failures[f"{what}:{type(exc).__name__}"] += 1
            self.breaker.failure()
            return None
        self.breaker.success()
        return result

    async def put(self, items: Sequence[tuple[bytes, Parts]]) -> list[bool]:
        """Persist payloads (each one buffer, or a page's chunks in order); True where the object
        is stored. Never raises.

        Objects are encoded into one reusable arena from the backend (`alloc_buffer`: memory
        a zero-copy backend sends from directly), grown to the largest batch, then reused — no
        fresh allocation, so no first-touch page faults, on the put path. Puts are serialized
        so the arena is never shared by two batches in flight; after a failed or timed-out
        call (whose thread may still read it) the arena is abandoned for a fresh one."""
        if self.backend.vectored_put:
            return await self._put_vectored(items)
        async with self._arena_lock:
            started = time.perf_counter()
            self.stats.puts += len(items)
            sizes = [object_format.encoded_size(key, payload_bytes(p)) for key, p in items]
            nbytes = sum(sizes)
            if self._arena is None or self._arena.nbytes < nbytes:
                self._arena = self.backend.alloc_buffer(nbytes)
            arena = self._arena
            # Encode chunk k+1 while chunk k is on its way: the copy and checksum (on this
            # thread) overlap the backend's send (its thread or the kernel), instead of the
            # whole batch being encoded before the first byte leaves. Each chunk has its own
            # region of the arena, so nothing is overwritten while in flight.
            result: list[bool] = []
            failed = False
            in_flight: tuple[asyncio.Future[list[bool] | None], int] | None = None
            offset = 0
            for chunk in _chunks(items, sizes, self.chunk_bytes):
                # on a worker thread, so the loop starts the previous chunk's send meanwhile
                encoded = await asyncio.to_thread(_encode, chunk, arena, offset)
                offset += sum(size for _, size in chunk)
                if in_flight is not None:
                    failed |= await _collect(in_flight, result)
                send = self._call("put", sum(size for _, size in chunk), self._sender(encoded))
                in_flight = (asyncio.ensure_future(send), len(chunk))
            if in_flight is not None:
                failed |= await _collect(in_flight, result)
            if failed:
                self._arena = None  # a timed-out call's thread may still read it
            stored = result
            self.stats.stored += sum(stored)
            self.stats.put_bytes += sum(
                payload_bytes(p) for (_, p), ok in zip(items, stored, strict=True) if ok
            )
            self.stats.put_seconds += time.perf_counter() - started
            return stored

    async def _put_vectored(self, items: Sequence[tuple[bytes, Parts]]) -> list[bool]:
        """No encoding buffer: each object goes out as its header, then its payload from the
        caller's memory (which the caller keeps unchanged until this returns). Where a chunk
        costs no extra round trip (`backend.chunked_put`: files), the headers of chunk k+1 —
        their checksums — are computed on a worker thread while chunk k is written (xxhash and
        write both release the GIL). For Redis one call measured faster: a round trip per
        chunk, and a third busy thread beside redis-server on two cores."""
        started = time.perf_counter()
        self.stats.puts += len(items)
        sizes = [payload_bytes(p) for _, p in items]
        if not self.backend.chunked_put:
            # one call, the headers computed lazily on the backend's thread as it sends
            lazy = _lazy_headers(items)
            result = await self._call("put", sum(sizes), lambda: self.backend.put_parts_many(lazy))
            done = result if result is not None else [False] * len(items)
            self.stats.stored += sum(done)
            self.stats.put_bytes += sum(s for s, ok in zip(sizes, done, strict=True) if ok)
            self.stats.put_seconds += time.perf_counter() - started
            return done
        chunk_bytes = self.chunk_bytes
        stored: list[bool] = []
        in_flight: tuple[asyncio.Future[list[bool] | None], int] | None = None
        for chunk in _chunks(items, sizes, chunk_bytes):
            parts = await asyncio.to_thread(_headers, chunk)
            if in_flight is not None:
                await _collect(in_flight, stored)
            send = self._call("put", sum(size for _, size in chunk), self._parts_sender(parts))
            in_flight = (asyncio.ensure_future(send), len(chunk))
        if in_flight is not None:
            await _collect(in_flight, stored)
        self.stats.stored += sum(stored)
        self.stats.put_bytes += sum(size for size, ok in zip(sizes, stored, strict=True) if ok)
        self.stats.put_seconds += time.perf_counter() - started
        return stored

    def _parts_sender(
        self, parts: list[tuple[bytes, Sequence[Buffer]]]
    ) -> Callable[[], Awaitable[list[bool]]]:
        return lambda: self.backend.put_parts_many(parts)

    def _sender(
        self, encoded: list[tuple[bytes, memoryview]]
    ) -> Callable[[], Awaitable[list[bool]]]:
        return lambda: self.backend.put_many(encoded)

    async def get(self, keys: Sequence[bytes], expected_bytes: int = 0) -> list[memoryview | None]:
        """Verified payloads, or None for each miss (absent, corrupt, or backend trouble)."""
        return (await self.fetch(keys, expected_bytes)).values

    async def fetch(self, keys: Sequence[bytes], expected_bytes: int = 0) -> Fetched:
        """Like `get`, and says whether the backend answered: a None then means the object is
        definitively absent or corrupt, not that the backend could not be asked."""
        self.stats.gets += len(keys)
        started = time.perf_counter()
        result = await self._call("get", expected_bytes, lambda: self.backend.get_many(keys))
        answered = result is not None
        raw: list[bytes | None] = result if result is not None else [None] * len(keys)
        out: list[memoryview | None] = []
        corrupt = []
        for key, data in zip(keys, raw, strict=True):
            if data is None:
                out.append(None)
                continue
            try:
                out.append(object_format.decode(key, data))
            except ObjectCorruptError:
                corrupt.append(key)
                out.append(None)
        if corrupt:
            self.stats.corrupt_dropped += len(corrupt)
            await self._call("delete", 0, lambda: self.backend.delete_many(corrupt))
        hits = sum(v is not None for v in out)
        self.stats.get_bytes += sum(v.nbytes for v in out if v is not None)
        self.stats.get_seconds += time.perf_counter() - started
        self.stats.hits += hits
        self.stats.misses += len(keys) - hits
        return Fetched(out, answered)

    async def fetch_into(
        self, keys: Sequence[bytes], targets: Sequence[list[memoryview]]
    ) -> tuple[list[bool], bool]:
        """Fetch each object's payload straight into its target buffers (a host page's
        chunks) and verify it there. Returns which landed valid, and whether the backend
        answered. A target that fails holds garbage: the caller must not use it."""
        self.stats.gets += len(keys)
        started = time.perf_counter()
        if not self.backend.vectored_get:  # the backend's bytes, then one copy into place
            self.stats.gets -= len(keys)  # fetch counts them
            nbytes = sum(sum(t.nbytes for t in target) for target in targets)
            fetched = await self.fetch(keys, nbytes)
            landed: list[bool] = []
            for value, target in zip(fetched.values, targets, strict=True):
                if value is None or value.nbytes != sum(t.nbytes for t in target):
                    landed.append(False)
                    continue
                offset = 0
                for part in target:
                    part[:] = value[offset : offset + part.nbytes]
                    offset += part.nbytes
                landed.append(True)
            return landed, fetched.answered
        async with self._get_lock:  # the headers land in the store's (registered) arena
            head_sizes = [object_format.HEADER_BYTES + len(k) for k in keys]
            if self._head_arena is None or self._head_arena.nbytes < sum(head_sizes):
                self._head_arena = self.backend.alloc_buffer(max(sum(head_sizes), 4096))
            heads, offset = [], 0
            for size in head_sizes:
                heads.append(self._head_arena[offset : offset + size])
                offset += size
            # read chunk k+1 while chunk k is verified on a worker thread (readv and xxhash
            # both release the GIL): the checksum no longer adds to the read time
            sizes = [sum(t.nbytes for t in target) for target in targets]
            chunks = _runs(sizes, self.chunk_bytes)
            ok: list[bool] = [False] * len(keys)
            corrupt: list[bytes] = []
            answered = True
            verifying: asyncio.Future[list[bool | None]] | None = None
            verifying_chunk: list[int] = []
            for chunk in chunks:
                scatter = [[heads[i], *targets[i]] for i in chunk]
                chunk_keys = [keys[i] for i in chunk]
                read = await self._call(
                    "get",
                    sum(sizes[i] for i in chunk),
                    self._scatter_reader(chunk_keys, scatter),
                )
                if verifying is not None:
                    self._settle(await verifying, verifying_chunk, keys, ok, corrupt)
                    verifying = None
                if read is None:
                    answered = False
                    self._head_arena = None  # a timed-out call may still write into it
                    break
                jobs = [
                    (keys[i], heads[i], targets[i], n) for i, n in zip(chunk, read, strict=True)
                ]
                verifying = asyncio.ensure_future(asyncio.to_thread(_verify_all, jobs))
                verifying_chunk = chunk
            if verifying is not None:
                self._settle(await verifying, verifying_chunk, keys, ok, corrupt)
        if corrupt:
            self.stats.corrupt_dropped += len(corrupt)
            await self._call("delete", 0, lambda: self.backend.delete_many(corrupt))
        hits = sum(ok)
        self.stats.hits += hits
        self.stats.misses += len(keys) - hits
        self.stats.get_bytes += sum(size for size, good in zip(sizes, ok, strict=True) if good)
        self.stats.get_seconds += time.perf_counter() - started
        return ok, answered

    def _scatter_reader(
        self, keys: list[bytes], scatter: list[list[memoryview]]
    ) -> Callable[[], Awaitable[list[int]]]:
        return lambda: self.backend.get_parts_many(keys, scatter)

    @staticmethod
    def _settle(
        outcomes: list[bool | None],
        chunk: list[int],
        keys: Sequence[bytes],
        ok: list[bool],
        corrupt: list[bytes],
    ) -> None:
        """Record a verified chunk: True valid, False corrupt (to delete), None absent."""
        for i, outcome in zip(chunk, outcomes, strict=True):
            ok[i] = outcome is True
            if outcome is False:
                corrupt.append(keys[i])

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return (await self.exists_answered(keys))[0]

    async def exists_answered(self, keys: Sequence[bytes]) -> tuple[list[bool], bool]:
        """Which keys L3 holds, and whether it answered at all (False: the call failed or the
        breaker skipped it, and every key reads as absent)."""
        result = await self._call("exists", 0, lambda: self.backend.exists_many(keys))
        if result is None:
            return [False] * len(keys), False
        return result, True

    async def delete(self, keys: Sequence[bytes]) -> bool:
        async def run() -> bool:
            await self.backend.delete_many(keys)
            return True

        return bool(await self._call("delete", 0, run))

    async def probe(self) -> BreakerState:
        """The background retry: when the breaker lets a trial call through (half-open), make
        one cheap call so a recovered backend closes it before the next engine request."""
        if self.breaker.state is BreakerState.HALF_OPEN:
            await self._call("probe", 0, lambda: self.backend.exists_many([PROBE_KEY]))
        return self.breaker.state
