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
16 MiB chunks, 3 failures, 5 s).

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
from typing import TypeVar

from hicache.errors import ObjectCorruptError
from hicache.storage import object_format
from hicache.storage.backend import FAILED, Buffer, Landed, StorageBackend
from hicache.storage.batches import (
    Gate,
    chunks,
    collect,
    encode_chunk,
    headers,
    lazy_headers,
    runs,
    verify_all,
)
from hicache.storage.breaker import (
    DEFAULT_FAILURE_THRESHOLD,
    DEFAULT_RESET_AFTER_S,
    BreakerState,
    CircuitBreaker,
)
from hicache.storage.fetch_handles import (
    Fetched,
    FetchedInto,
    FetchInto,
    Outstanding,
    retrieve_quietly,
)
from hicache.storage.object_format import Parts, payload_bytes

T = TypeVar("T")


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
        self.breaker = breaker or CircuitBreaker(
            DEFAULT_FAILURE_THRESHOLD if failure_threshold is None else failure_threshold,
            DEFAULT_RESET_AFTER_S if reset_after_s is None else reset_after_s,
        )
        self.base_timeout_s = _positive("base_timeout_s", base_timeout_s)
        self.min_bandwidth = _positive("min_bandwidth_bytes_per_s", min_bandwidth_bytes_per_s)
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"GuardedStore chunk_bytes={chunk_bytes!r}: must be an int >= 1")
        self.stats = StoreStats()
        self.chunk_bytes = chunk_bytes
        self._arena: memoryview | None = None
        self._arena_lock = asyncio.Lock()
        self._head_arena: memoryview | None = None
        self._get_lock = asyncio.Lock()

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

    def _failed(
        self,
        reason: str,
        exc: BaseException | None = None,
        note: str | None = None,
        count: int = 1,
    ) -> None:
        """Count a failed call (or `count` failed keys) under `reason` ("what:how") and
        tell the breaker why, once."""
        self.stats.failures[reason] += count
        detail = note if exc is None else str(exc)
        self.breaker.failure(reason if not detail else f"{reason}: {detail[:200]}")

    def _timeout(self, nbytes: int) -> float:
        return self.base_timeout_s + nbytes / self.min_bandwidth

    async def _call(
        self, what: str, nbytes: int, coro_factory: Callable[[], Awaitable[T]]
    ) -> T | None:
        """Run one backend call under the breaker and a timeout; None means 'treat as miss'."""
        return (await self._call_why(what, nbytes, coro_factory))[0]

    async def _call_why(
        self, what: str, nbytes: int, coro_factory: Callable[[], Awaitable[T]]
    ) -> tuple[T | None, str | None]:
        """`_call`, and why it gave None: "open", "timeout" or the exception's name. On a
        timeout the call is cancelled: only for calls whose threads touch no caller memory
        that outlives them (scatter reads go through `_detached`)."""
        if not self.breaker.allow():
            self.stats.skipped_open += 1
            return None, "open"
        try:
            result = await asyncio.wait_for(coro_factory(), self._timeout(nbytes))
        except TimeoutError:
            self._failed(f"{what}:timeout")
            return None, "timeout"
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        except Exception as exc:  # every backend error becomes a miss; counted by reason
            self._failed(f"{what}:{type(exc).__name__}", exc)
            return None, type(exc).__name__
        self.breaker.success()
        return result, None

    async def _detached(
        self,
        what: str,
        nbytes: int,
        start: Callable[[], Awaitable[T]],
        outstanding: Outstanding,
    ) -> tuple[T | None, str | None]:
        """Like `_call_why` for a call whose threads write caller memory: on a timeout (or a
        cancelled caller) the call is left running — never cancelled — and tracked in
        `outstanding` until it ends. The breaker's failure is recorded here; its success is
        the caller's to record (a result may still hold failed keys)."""
        call = self._launch(start, outstanding)
        if call is None:
            return None, "open"
        return await self._settle_call(what, nbytes, call)

    def _launch(
        self, start: Callable[[], Awaitable[T]], outstanding: Outstanding
    ) -> asyncio.Future[T] | None:
        """Start a `_detached` call now (None: the breaker is open), tracked in `outstanding`."""
        if not self.breaker.allow():
            self.stats.skipped_open += 1
            return None
        call = asyncio.ensure_future(start())
        call.add_done_callback(retrieve_quietly)
        outstanding.track(call)
        return call

    async def _settle_call(
        self, what: str, nbytes: int, call: asyncio.Future[T]
    ) -> tuple[T | None, str | None]:
        """Wait for a launched call within the timeout for `nbytes` (the rest of `_detached`)."""
        try:
            done, _ = await asyncio.wait({call}, timeout=self._timeout(nbytes))
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        if not done:
            self._failed(f"{what}:timeout")
            return None, "timeout"
        exc = call.exception() if not call.cancelled() else asyncio.CancelledError()
        if exc is not None:
            self._failed(f"{what}:{type(exc).__name__}", exc)
            return None, type(exc).__name__
        return call.result(), None

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
            for chunk in chunks(items, sizes, self.chunk_bytes):
                # on a worker thread, so the loop starts the previous chunk's send meanwhile
                encoded = await asyncio.to_thread(encode_chunk, chunk, arena, offset)
                offset += sum(size for _, size in chunk)
                if in_flight is not None:
                    failed |= await collect(in_flight, result)
                send = self._call("put", sum(size for _, size in chunk), self._sender(encoded))
                in_flight = (asyncio.ensure_future(send), len(chunk))
            if in_flight is not None:
                failed |= await collect(in_flight, result)
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
                result = await self._call(
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
            send = self._call("put", sum(size for _, size in chunk), self._parts_sender(parts))
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
        result, why = await self._call_why(
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
            await self._call("delete", 0, lambda: self.backend.delete_many(corrupt))
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
        self.stats.gets += len(keys)
        started = time.perf_counter()
        ok: list[bool] = [False] * len(keys)
        answered_keys: list[bool] = [False] * len(keys)
        corrupt: list[bytes] = []
        async with self._get_lock:  # the headers land in the store's (registered) arena
            try:
                timed_out = await self._scatter(
                    keys, targets, sizes, ok, answered_keys, corrupt, outstanding
                )
            finally:
                if not outstanding.idle:  # a read still running may write the head arena
                    self._head_arena = None
        if corrupt:
            self.stats.corrupt_dropped += len(corrupt)
            await self._call("delete", 0, lambda: self.backend.delete_many(corrupt))
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
        todo = runs(sizes, self.chunk_bytes)
        started: list[tuple[asyncio.Future[list[int]] | None, Gate, dict[int, bool | None]]] = []

        def launch(chunk: list[int]) -> None:
            gate = Gate()
            early: dict[int, bool | None] = {}
            landed = self._verifier(chunk, keys, heads, targets, gate, early) if streamed else None
            scatter = [[heads[i], *targets[i]] for i in chunk]
            reader = self._scatter_reader([keys[i] for i in chunk], scatter, landed)
            started.append((self._launch(reader, outstanding), gate, early))

        for k, chunk in enumerate(todo):
            if len(started) == k:
                launch(chunk)
            # the next chunk only while the breaker is closed: half-open lets one trial call
            # through, and a chunk launched beside it would be refused though the trial
            # succeeds (the first fetch after an outage would lose all but its first chunk)
            if len(started) == k + 1 < len(todo) and self.breaker.state is BreakerState.CLOSED:
                launch(todo[k + 1])
            call, gate, early = started[k]
            read: list[int] | None = None
            why: str | None = "open"
            if call is not None:
                settled = await self._settle_call("get", sum(sizes[i] for i in chunk), call)
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
                self._failed(
                    "get:key_failed", note=f"{len(failed)} of {len(chunk)} keys", count=len(failed)
                )
            else:
                self.breaker.success()
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
