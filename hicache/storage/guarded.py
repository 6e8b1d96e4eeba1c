"""`GuardedStore`: the L3 tier as the rest of hicache sees it — misses, never exceptions.

Every object is written with a header and checksum and verified on read; a corrupt object is
deleted, counted and reported as a miss. A damaged one — something that is not an object
where one should be (a directory or FIFO in place of a file, a Redis list under its key) — is
a miss the backend counts (`objects_damaged`); neither feeds the breaker, which hears only of
calls that failed as a whole or keys the backend could not answer for. Each call has a
timeout derived from its bytes (`base_timeout_s + bytes / min_bandwidth_bytes_per_s`).
A `CircuitBreaker` counts failures (and keeps the latest one's reason, for `/readyz`):
after `failure_threshold` in a row it opens and calls return misses at once without touching
the backend; after `reset_after_s` the next call is a trial (half-open) that closes the
breaker on success or re-opens it on failure (`breaker.py`). Backend-native errors are mapped to
`TierUnavailableError` and counted by reason; none propagate. Timeouts, chunk size and the
breaker's thresholds are constructor parameters, checked there (defaults: 1 s + 50 MB/s,
16 MiB chunks, 3 failures, 5 s). The store composes two parts: `GuardedCalls` (`calls.py`),
through which every backend call goes, and `ScatterReads` (`scatter_reads.py`), which reads
`fetch_into`'s objects straight into caller memory where the backend can.

Fetches into caller memory (`fetch_into`) and their lifecycle. The payloads land in the
caller's host pages on a backend thread (file `readv`, Mooncake's scatter read), and a thread
cannot be stopped. So a timed-out or cancelled fetch stops *waiting* at once but never stops
*tracking*: the rule (trio's) is that a thread once started is awaited, and a page is not
reusable while a thread may still write it.

    fetch = store.fetch_into(keys, targets)   # starts now; the handle has `settled`
    result = await fetch                      # FetchedInto; prompt even when L3 hangs
    ...index the pages with result.ok[i]...
    fetch.settled.add_done_callback(free_the_pages_not_indexed)   # or: await fetch.settled

- `await fetch` returns within the byte-scaled timeout per chunk (or raises CancelledError
  when the awaiting task is cancelled, which also stops further chunks). `ok[i]` is True only
  for an object read to the end and verified in its targets; a timed-out read is never
  verified and never True. `answered_keys[i]` says the backend answered for key i (ok False
  there is a definite miss: absent, or corrupt and deleted); `answered` is all of them.
- `settled` (on the handle and on the result; the same future) is done once no thread of this
  fetch can read or write `targets` any more — already done on return when nothing is
  outstanding. Free or reuse a target page only after it. The scatter call itself is never
  cancelled (the backend's contract: its coroutine ends only when its threads do), so a
  backend that never returns leaks those pages rather than corrupting them.
- Unpacking `ok, answered = await ...` still works (the shape before `settled`), for callers
  that keep their target pages alive regardless.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from hicache.errors import ObjectCorruptError
from hicache.storage import object_format
from hicache.storage.backend import Buffer, StorageBackend
from hicache.storage.batches import (
    Gate,
    chunks,
    collect,
    encode_chunk,
    headers,
    lazy_headers,
    runs,
)
from hicache.storage.breaker import (
    DEFAULT_FAILURE_THRESHOLD,
    DEFAULT_RESET_AFTER_S,
    BreakerState,
    CircuitBreaker,
)
from hicache.storage.calls import GuardedCalls
from hicache.storage.fetch_handles import (
    Fetched,
    FetchedInto,
    FetchInto,
    Outstanding,
    retrieve_quietly,
)
from hicache.storage.object_format import Parts, payload_bytes
from hicache.storage.scatter_reads import ScatterReads

PROBE_KEY = b"hicache-breaker-probe"


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value)) or value <= 0:
        raise ValueError(f"GuardedStore {name}={value!r}: must be a finite number > 0")
    return float(value)


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
        chunk_bytes: int = 16 << 20,
        failure_threshold: int | None = None,
        reset_after_s: float | None = None,
    ):
        """`failure_threshold` / `reset_after_s` build the breaker (defaults 3 and 5 s); give
        them or a ready `breaker`, not both."""
        if breaker is not None and (failure_threshold is not None or reset_after_s is not None):
            raise ValueError(
                "GuardedStore: breaker= was given together with failure_threshold= / "
                "reset_after_s=; give the thresholds or a CircuitBreaker, not both"
            )
        self.backend = backend
        breaker = breaker or CircuitBreaker(
            DEFAULT_FAILURE_THRESHOLD if failure_threshold is None else failure_threshold,
            DEFAULT_RESET_AFTER_S if reset_after_s is None else reset_after_s,
        )
        base_timeout_s = _positive("base_timeout_s", base_timeout_s)
        min_bandwidth = _positive("min_bandwidth_bytes_per_s", min_bandwidth_bytes_per_s)
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"GuardedStore chunk_bytes={chunk_bytes!r}: must be an int >= 1")
        self.stats = StoreStats()
        # every backend call goes through `calls` (breaker, timeouts); reads straight into
        # caller memory through `scatter`
        self.calls = GuardedCalls(breaker, self.stats, base_timeout_s, min_bandwidth)
        self.chunk_bytes = chunk_bytes
        self._arena: memoryview | None = None
        self._arena_lock = asyncio.Lock()
        self.scatter = ScatterReads(backend, self.calls, self.stats)
        self._probing: asyncio.Future[list[bool]] | None = None  # the probe's latest call

    @property
    def breaker(self) -> CircuitBreaker:
        return self.calls.breaker

    @property
    def base_timeout_s(self) -> float:
        """Every call's timeout: this, plus its bytes at `min_bandwidth`."""
        return self.calls.base_timeout_s

    @base_timeout_s.setter
    def base_timeout_s(self, value: float) -> None:
        self.calls.base_timeout_s = value

    @property
    def min_bandwidth(self) -> float:
        return self.calls.min_bandwidth

    @min_bandwidth.setter
    def min_bandwidth(self, value: float) -> None:
        self.calls.min_bandwidth = value

    def effective_settings(self) -> dict[str, object]:
        """What this store runs with, by the deployment key each comes from: the backend
        (its kind, where it is, its prefix and budget where it has them), the call timeouts,
        the chunk size and the breaker's thresholds."""
        backend = self.backend
        where = {
            f"storage.{attr}": str(getattr(backend, attr))
            for attr in ("root", "where", "master_address", "key_prefix", "capacity_bytes")
            if hasattr(backend, attr)
        }
        return {
            "storage.backend": type(backend).__name__,
            **where,
            "storage.base_timeout_s": self.base_timeout_s,
            "storage.min_bandwidth_bytes_per_s": self.min_bandwidth,
            "storage.chunk_bytes": self.chunk_bytes,
            "storage.breaker_failure_threshold": self.breaker.failure_threshold,
            "storage.breaker_reset_after_s": self.breaker.reset_after_s,
        }

    @property
    def objects_damaged(self) -> int:
        """Things met where an object should be that were not one (the backend's count)."""
        return self.backend.damaged()

    async def put(self, items: Sequence[tuple[bytes, Parts]]) -> list[bool]:
        """Persist payloads (each one buffer, or a page's chunks in order); True where the object
        is stored. Never raises.

        Objects are encoded into one reusable arena from the backend (`alloc_buffer`: memory
        a zero-copy backend sends from directly), grown to the largest batch, then reused — no
        fresh allocation, so no first-touch page faults, on the put path. Puts are serialized
        so the arena is never shared by two batches in flight; after a failed or timed-out
        call, or a caller cancelled mid-batch (a thread may still read it either way), the
        arena is abandoned for a fresh one."""
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
            try:
                for chunk in chunks(items, sizes, self.chunk_bytes):
                    # on a worker thread, so the loop starts the previous chunk's send meanwhile
                    encoded = await asyncio.to_thread(encode_chunk, chunk, arena, offset)
                    offset += sum(size for _, size in chunk)
                    if in_flight is not None:
                        failed |= await collect(in_flight, result)
                    chunk_nbytes = sum(size for _, size in chunk)
                    send = self.calls.call("put", chunk_nbytes, self._sender(encoded))
                    in_flight = (asyncio.ensure_future(send), len(chunk))
                if in_flight is not None:
                    failed |= await collect(in_flight, result)
            except BaseException:
                # cancelled mid-batch (the persist worker stopped, L3 detached): a send or an
                # encode may still run on its thread over the arena, so the next batch must
                # not write into it
                self._arena = None
                raise
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
        chunk, and a third busy thread beside redis-server on two cores.

        After a timeout the backend's thread may still read the payload (a thread cannot be
        stopped): every header sent was computed before the store gave up (chunked: before
        the call; lazy: under `Gate`), so a payload the caller changes afterwards fails its
        checksum on read and is deleted — never served as another page's bytes."""
        started = time.perf_counter()
        self.stats.puts += len(items)
        sizes = [payload_bytes(p) for _, p in items]
        if not self.backend.chunked_put:
            # one call, the headers computed lazily on the backend's thread as it sends; the
            # gate stops that once this call is given up (timed out, failed or cancelled)
            gate = Gate()
            lazy = lazy_headers(items, gate)
            try:
                result = await self.calls.call(
                    "put", sum(sizes), lambda: self.backend.put_parts_many(lazy)
                )
            finally:
                gate.close()
            done = result if result is not None else [False] * len(items)
            self.stats.stored += sum(done)
            self.stats.put_bytes += sum(s for s, ok in zip(sizes, done, strict=True) if ok)
            self.stats.put_seconds += time.perf_counter() - started
            return done
        chunk_bytes = self.chunk_bytes
        stored: list[bool] = []
        in_flight: tuple[asyncio.Future[list[bool] | None], int] | None = None
        for chunk in chunks(items, sizes, chunk_bytes):
            parts = await asyncio.to_thread(headers, chunk)
            if in_flight is not None:
                await collect(in_flight, stored)
            send = self.calls.call("put", sum(size for _, size in chunk), self._parts_sender(parts))
            in_flight = (asyncio.ensure_future(send), len(chunk))
        if in_flight is not None:
            await collect(in_flight, stored)
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
        result, why = await self.calls.call_why(
            "get", expected_bytes, lambda: self.backend.get_many(keys)
        )
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
            await self.calls.call("delete", 0, lambda: self.backend.delete_many(corrupt))
        hits = sum(v is not None for v in out)
        self.stats.get_bytes += sum(v.nbytes for v in out if v is not None)
        self.stats.get_seconds += time.perf_counter() - started
        self.stats.hits += hits
        self.stats.misses += len(keys) - hits
        return Fetched(out, answered, timed_out=why == "timeout")

    def fetch_into(self, keys: Sequence[bytes], targets: Sequence[list[memoryview]]) -> FetchInto:
        """Fetch each object's payload straight into its target buffers (a host page's
        chunks) and verify it there. Starts at once (a task on the running loop) and returns
        the handle: `await` it for the `FetchedInto`; free or reuse a target only once
        `settled` is done (the module docstring has the whole lifecycle). A target that is
        not `ok` holds garbage: the caller must not use it."""
        if len(keys) != len(targets):
            raise ValueError(
                f"GuardedStore.fetch_into: {len(keys)} keys but {len(targets)} targets; "
                "give one target (a list of buffers) per key"
            )
        keys, targets = list(keys), list(targets)
        return FetchInto(lambda outstanding: self._fetch_into(keys, targets, outstanding))

    async def _fetch_into(
        self,
        keys: list[bytes],
        targets: list[list[memoryview]],
        outstanding: Outstanding,
    ) -> FetchedInto:
        sizes = [sum(t.nbytes for t in target) for target in targets]
        if not self.backend.vectored_get:  # the backend's bytes, then one copy into place
            # chunk by chunk (~chunk_bytes each): one pipeline of a whole batch's replies
            # (256 MiB) made redis-py's reader measure ~3x slower than 16 MiB ones
            landed: list[bool] = [False] * len(keys)
            answered = [False] * len(keys)
            timed_out = False
            for chunk in runs(sizes, self.chunk_bytes):
                fetched = await self.fetch(
                    [keys[i] for i in chunk], sum(sizes[i] for i in chunk)
                )  # copies on the loop: no thread
                for i, value in zip(chunk, fetched.values, strict=True):
                    answered[i] = fetched.answered
                    if value is None or value.nbytes != sizes[i]:
                        continue
                    offset = 0
                    for part in targets[i]:
                        part[:] = value[offset : offset + part.nbytes]
                        offset += part.nbytes
                    landed[i] = True
                if not fetched.answered:  # the backend failed: the later chunks are not asked
                    timed_out = fetched.timed_out
                    break
            outstanding.close()
            return FetchedInto(landed, all(answered), answered, timed_out, outstanding.settled)
        return await self.scatter.read(keys, targets, sizes, outstanding, self.chunk_bytes)

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return (await self.exists_answered(keys))[0]

    async def exists_answered(self, keys: Sequence[bytes]) -> tuple[list[bool], bool]:
        """Which keys L3 holds, and whether it answered at all (False: the call failed or the
        breaker skipped it, and every key reads as absent)."""
        result = await self.calls.call("exists", 0, lambda: self.backend.exists_many(keys))
        if result is None:
            return [False] * len(keys), False
        return result, True

    async def delete(self, keys: Sequence[bytes]) -> bool:
        async def run() -> bool:
            await self.backend.delete_many(keys)
            return True

        return bool(await self.calls.call("delete", 0, run))

    async def probe(self) -> BreakerState:
        """The background retry (`PROBE_INTERVAL_S`): while the breaker is open or half-open,
        one cheap call, without waiting for `reset_after_s` (`CircuitBreaker.allow_probe`),
        so a recovered backend closes it within one probe interval and one call. A probe
        call that timed out is left to end, never cancelled, and no other probe starts
        until it has: a backend whose calls hang on its threads (Mooncake's RPC timeout
        outlasts ours) never gets a pile of them, one per interval."""
        if self.breaker.state is BreakerState.CLOSED:
            return self.breaker.state
        if self._probing is not None and not self._probing.done():
            return self.breaker.state  # the last probe's call still runs
        if not self.breaker.allow_probe():
            return self.breaker.state
        call = asyncio.ensure_future(self.backend.exists_many([PROBE_KEY]))
        call.add_done_callback(retrieve_quietly)
        self._probing = call
        try:
            done, _ = await asyncio.wait({call}, timeout=self.calls.timeout(0))
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        if not done:
            self.calls.failed("probe:timeout")
        elif call.cancelled():
            self.calls.failed("probe:cancelled")
        elif (exc := call.exception()) is not None:
            self.calls.failed(f"probe:{type(exc).__name__}", exc)
        else:
            self.breaker.success()
        return self.breaker.state
