"""`GuardedStore`: the L3 tier as the rest of hicache sees it — misses, never exceptions.

Every object is written with a header and checksum and verified on read; a corrupt object is
deleted, counted and reported as a miss. Each call has a timeout derived from its bytes
(`base_timeout_s + bytes / min_bandwidth_bytes_per_s`). A `CircuitBreaker` counts failures:
after `failure_threshold` in a row it opens and calls return misses at once without touching
the backend; after `reset_after_s` the next call is a trial (half-open) that closes the
breaker on success or re-opens it on failure. Backend-native errors are mapped to
`TierUnavailableError` and counted by reason; none propagate.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

from hicache.errors import ObjectCorruptError
from hicache.storage import object_format
from hicache.storage.backend import StorageBackend

T = TypeVar("T")


PROBE_KEY = b"hicache-breaker-probe"


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 3,
        reset_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.failure_threshold = failure_threshold
        self.reset_after_s = reset_after_s
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_in_flight = False

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at >= self.reset_after_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allow(self) -> bool:
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._trial_in_flight = False

    def failure(self) -> None:
        self._trial_in_flight = False
        self._failures += 1
        if self._opened_at is not None or self._failures >= self.failure_threshold:
            self._opened_at = self._clock()


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


class GuardedStore:
    def __init__(
        self,
        backend: StorageBackend,
        *,
        breaker: CircuitBreaker | None = None,
        base_timeout_s: float = 1.0,
        min_bandwidth_bytes_per_s: float = 50e6,
    ):
        self.backend = backend
        self.breaker = breaker or CircuitBreaker()
        self.base_timeout_s = base_timeout_s
        self.min_bandwidth = min_bandwidth_bytes_per_s
        self.stats = StoreStats()
        self._arena = bytearray()
        self._arena_lock = asyncio.Lock()

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

    async def put(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        """Persist payloads; True where the object is stored. Never raises.

        Objects are encoded into one reusable arena (grown to the largest batch, then reused:
        no fresh allocation, so no first-touch page faults, on the put path); puts are
        serialized so the arena is never shared by two batches in flight."""
        async with self._arena_lock:
            started = time.perf_counter()
            self.stats.puts += len(items)
            sizes = [object_format.encoded_size(key, memoryview(p).nbytes) for key, p in items]
            nbytes = sum(sizes)
            if len(self._arena) < nbytes:
                self._arena = bytearray(nbytes)
            arena = memoryview(self._arena)
            encoded: list[tuple[bytes, memoryview]] = []
            offset = 0
            for (key, payload), size in zip(items, sizes, strict=True):
                object_format.encode_into(arena[offset : offset + size], key, payload)
                encoded.append((key, arena[offset : offset + size]))
                offset += size
            try:
                result = await self._call("put", nbytes, lambda: self.backend.put_many(encoded))
            finally:
                try:
                    for _, view in encoded:
                        view.release()
                    arena.release()
                except BufferError:
                    # a timed-out call's thread still reads the arena: leave it to that
                    # thread and encode the next batch into a fresh one
                    self._arena = bytearray()
            stored = result if result is not None else [False] * len(items)
            self.stats.stored += sum(stored)
            self.stats.put_bytes += sum(
                memoryview(p).nbytes for (_, p), ok in zip(items, stored, strict=True) if ok
            )
            self.stats.put_seconds += time.perf_counter() - started
            return stored

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

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        result = await self._call("exists", 0, lambda: self.backend.exists_many(keys))
        return result if result is not None else [False] * len(keys)

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
