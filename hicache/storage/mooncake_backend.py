"""`MooncakeBackend`: L3 on a Mooncake Store (the `mooncake-transfer-engine` wheels; the
non-CUDA one on CPU machines, which needs Debian's libibverbs1 even for TCP).

The client joins the cluster at construction (`setup`: local hostname, metadata server —
P2PHANDSHAKE needs no extra server —, segment sizes, protocol, master address). A dead master
fails calls fast with negative status codes (the client reconnects by itself when it
returns); those, and any exception, are mapped to `TierUnavailableError`. The client's calls
are blocking, so they run on one worker thread of this backend's own; the loop never blocks.

Zero copy: `alloc_buffer` returns memory registered with the client (`register_buffer`), and
the host tier registers its pools (`register_memory`). Puts of parts (`put_parts_many`)
whose payloads all lie in registered memory copy only the ~48-byte header, into a small
registered scratch buffer, and send header and payload from where they are with
`batch_put_from_multi_buffers`. That call is a `put`, which keeps an existing key's old value
(answer 0), so each chunk's keys are first removed with `batch_remove(force=True)` (which
also replaces an object someone is reading): between the two the key reads as a miss, and
of two writers racing on one key the first put wins (both write valid objects). A key whose
removal is refused, whose payload is not registered, or that the store refused as full
(-200) after its removal, is copied into registered scratch and upserted
(`batch_upsert_from`); if the header scratch cannot be registered nothing is removed and
every key goes that way; buffers from nowhere registered fall back to
`upsert_batch`. Fetches scatter with `batch_get_into_multi_buffers` straight into host
pages; `get_batch` serves plain `get`s. Throughput against the raw calls:
benchmarks/storage.py. Registrations are released at `close`.

Status codes (Mooncake's `ErrorCode`, mooncake-store/include/types.h; what this wheel
returns was measured against a real master, tests/storage/test_mooncake.py) are read per key:

    read code                               meaning here
    >= 0                                    bytes read
    -704 OBJECT_NOT_FOUND, -703             absent: a miss (`MISSING`), the index may drop it
      REPLICA_IS_NOT_READY, -712
      REPLICA_IS_GONE
    -600 INVALID_PARAMS, -800 TRANSFER_FAIL ambiguous: this wheel returns them for targets
                                            smaller / larger than the object, and also for a
                                            bad call / a failed transfer (a dead or
                                            unreachable segment owner). `get_size` decides:
                                            another size -> 0 bytes (a verified miss: the
                                            store deletes it); the same size -> `FAILED`;
                                            -704 -> `MISSING`; an error -> `FAILED`
    anything else (-900 RPC_FAIL: master    `FAILED`: a backend failure for that key (breaker;
      down, -1 INTERNAL_ERROR, ...)         the index keeps its entry; nothing is deleted)

`get_batch` returns an empty value both for an absent key and for a dead master, so its
empty answers are checked with `batch_is_exist` (0 absent; 1 or an error: the call failed).
Upserts: 0 stored; -200 NO_AVAILABLE_HANDLE (the store is full right now) is "not stored",
not a failure; any other negative code fails the call. Removes: 0 and the absent codes are
done, -706 OBJECT_HAS_LEASE (someone is reading it) leaves it; others fail the call.
The client object is `_store` (tests wrap it to inject codes the real client returns only on
faults they cannot produce on demand).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from hicache.errors import TierUnavailableError
from hicache.storage.backend import FAILED, MISSING, Buffer, Landed, StorageBackend

T = TypeVar("T")

# Mooncake's ErrorCode values this backend tells apart (mooncake-store/include/types.h)
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200  # no space for a put right now
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
REPLICA_IS_GONE = -712
TRANSFER_FAIL = -800
RPC_FAIL = -900  # the master is unreachable
ABSENT = frozenset({OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, REPLICA_IS_GONE})
# a scatter read's "targets smaller / larger than the object" on this wheel, but also a bad
# call and a failed transfer: resolved with get_size, never taken as a size mismatch alone
AMBIGUOUS = frozenset({INVALID_PARAMS, TRANSFER_FAIL})


class MooncakeBackend(StorageBackend):
    name = "mooncake"

    def __init__(
        self,
        master_address: str,
        *,
        local_hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        global_segment_bytes: int = 256 << 20,
        local_buffer_bytes: int = 256 << 20,
        protocol: str = "tcp",
        rdma_devices: str = "",
        key_prefix: str = "hicache:",
    ):
        from mooncake.store import MooncakeDistributedStore

        self.master_address = master_address
        self.key_prefix = key_prefix
        self._store: Any = MooncakeDistributedStore()
        status = self._store.setup(
            local_hostname,
            metadata_server,
            global_segment_bytes,
            local_buffer_bytes,
            protocol,
            rdma_devices,
            master_address,
        )
        if status != 0:
            raise TierUnavailableError(
                f"mooncake store setup against master {master_address} failed with status "
                f"{status}; check that mooncake_master runs there"
            )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-mooncake")
        self._registered: list[tuple[int, int, np.ndarray[Any, np.dtype[np.uint8]]]] = []
        self._scratches: dict[str, memoryview] = {}  # used on the client's thread only

    def alloc_buffer(self, nbytes: int) -> memoryview:
        array = np.empty(max(nbytes, 1), dtype=np.uint8)
        base = int(array.ctypes.data)
        status = self._store.register_buffer(base, array.nbytes)
        if status != 0:  # not fatal: puts fall back to the copying API
            return array.data
        self._registered.append((base, array.nbytes, array))
        return array.data

    def register_memory(self, view: memoryview) -> None:
        array = np.frombuffer(view, dtype=np.uint8)
        base = int(array.ctypes.data)
        if self._address(view) is not None:
            return
        if self._store.register_buffer(base, array.nbytes) == 0:
            self._registered.append((base, array.nbytes, array))

    def _address(self, view: memoryview) -> int | None:
        """The address of a view lying inside a registered buffer, else None."""
        address = int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0
        for base, size, _ in self._registered:
            if base <= address and address + view.nbytes <= base + size:
                return address
        return None

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        return [f"{self.key_prefix}{k.hex()}" for k in keys]

    async def _run(self, what: str, fn: Callable[[], T]) -> T:
        def call() -> T:
            try:
                return fn()
            except TierUnavailableError:
                raise
            except Exception as exc:
                raise TierUnavailableError(
                    f"mooncake {what} at {self.master_address}: {type(exc).__name__}: {exc}"
                ) from exc

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def _check(self, what: str, status: int) -> None:
        if status < 0:
            raise TierUnavailableError(
                f"mooncake {what} at {self.master_address} failed with status {status}"
            )

    async def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        return await self._run("upsert", lambda: self._upsert([(k, [d]) for k, d in items]))

    vectored_put = True
    chunked_put = True  # a chunk costs one remove and one put RPC more, no extra copy

    async def put_parts_many(self, items: Iterable[tuple[bytes, Sequence[Buffer]]]) -> list[bool]:
        """Each object as [header, payload parts...]. Where every payload part lies in
        registered memory (the host pools), the object goes out with no copy at all: the
        header is copied into a small registered scratch and `batch_put_from_multi_buffers`
        sends header and payload from where they are. That call is a `put`, which keeps an
        existing key's old value (and still answers 0), so the keys are first removed
        (`batch_remove`, forced: an upsert overwrites a leased object too); a key whose
        removal is refused, or that a full store (-200) refused after its removal, goes
        the copying way. Other objects are copied into the registered put scratch and
        upserted (`batch_upsert_from`)."""
        listed = [(k, [memoryview(p).cast("B") for p in parts]) for k, parts in items]
        return await self._run("put_parts", lambda: self._put_parts(listed))

    def _put_parts(self, items: list[tuple[bytes, list[memoryview]]]) -> list[bool]:
        """On the client's thread (so the scratch buffers are never shared)."""
        direct: list[int] = []
        ptrs: list[list[int]] = []
        for i, (_, parts) in enumerate(items):
            payload = [p for p in parts[1:] if p.nbytes]
            addresses = [self._address(p) for p in payload]
            if all(a is not None for a in addresses):
                direct.append(i)
                ptrs.append([a for a in addresses if a is not None])
        out = [False] * len(items)
        if direct:
            # the header scratch before anything is removed: unregistered (registration
            # failed), the direct path is not taken at all and nothing is deleted
            head_bytes = sum(items[i][1][0].nbytes for i in direct)
            scratch = self._scratch("head", head_bytes)
            base = self._address(scratch[:1])
            if base is None:
                direct, ptrs = [], []
        in_direct = set(direct)
        copied = [i for i in range(len(items)) if i not in in_direct]
        if direct:
            assert base is not None
            names = self._names([items[i][0] for i in direct])
            removed = self._store.batch_remove(names, True)
            if not isinstance(removed, list):  # a count on older wheels: unknown per key
                removed = [INTERNAL_ERROR] * len(names)
            keep = [j for j, code in enumerate(removed) if code == 0 or code in ABSENT]
            kept = set(keep)
            copied += [direct[j] for j in range(len(direct)) if j not in kept]
            all_ptrs, all_sizes, offset = [], [], 0
            for j in keep:
                head = items[direct[j]][1][0]
                scratch[offset : offset + head.nbytes] = head
                payload = [p for p in items[direct[j]][1][1:] if p.nbytes]
                all_ptrs.append([base + offset, *ptrs[j]])
                all_sizes.append([head.nbytes, *(p.nbytes for p in payload)])
                offset += head.nbytes
            if keep:
                codes = self._store.batch_put_from_multi_buffers(
                    [names[j] for j in keep], all_ptrs, all_sizes
                )
                for j, code in zip(keep, codes, strict=True):
                    if code == NO_AVAILABLE_HANDLE:
                        # the store is full right now, and the old object is already removed:
                        # one more try the copying way (an upsert), so a full store costs
                        # this put, not an object another sidecar may count on
                        copied.append(direct[j])
                        continue
                    self._check("put_from_multi_buffers", code)
                    out[direct[j]] = code == 0
        if copied:
            copied.sort()
            for i, stored in zip(copied, self._upsert([items[i] for i in copied]), strict=True):
                out[i] = stored
        return out

    def _scratch(self, which: str, nbytes: int) -> memoryview:
        """A registered buffer of at least `nbytes` kept for this client thread's use,
        grown (and the old one unregistered) when too small."""
        have = self._scratches.get(which)
        if have is not None and have.nbytes >= nbytes:
            return have
        if have is not None:
            self._release(have)
        grown = self.alloc_buffer(max(nbytes, 2 * (have.nbytes if have is not None else 0), 4096))
        if self._address(grown[:1]) is not None:  # unregistered: not kept, tried again next time
            self._scratches[which] = grown
        else:
            self._scratches.pop(which, None)
        return grown

    def _release(self, view: memoryview) -> None:
        base = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        for entry in self._registered:
            if entry[0] == base:
                self._registered.remove(entry)
                self._store.unregister_buffer(base)
                return

    def _upsert(self, items: Sequence[tuple[bytes, Sequence[memoryview | Buffer]]]) -> list[bool]:
        """Objects (each as parts, concatenated) upserted from registered memory: payloads
        already in one registered buffer go out from there, the rest are copied into the put
        scratch first; `upsert_batch` (a copy through the client) where registration failed."""
        names = self._names([k for k, _ in items])
        views = [[memoryview(p).cast("B") for p in parts] for _, parts in items]
        addresses = [self._address(v[0]) if len(v) == 1 else None for v in views]
        sizes = [sum(p.nbytes for p in v) for v in views]
        if any(a is None for a in addresses):
            scratch = self._scratch(
                "put", sum(s for s, a in zip(sizes, addresses, strict=False) if a is None)
            )
            base = self._address(scratch[:1])
            if base is None:  # registration failed: the copying client call
                values = [b"".join(v) for v in views]
                status = self._store.upsert_batch(names, values)
                if status != NO_AVAILABLE_HANDLE:
                    self._check("upsert", status)
                return [status == 0] * len(items)
            offset = 0
            for i, v in enumerate(views):
                if addresses[i] is None:
                    addresses[i] = base + offset
                    for part in v:
                        scratch[offset : offset + part.nbytes] = part
                        offset += part.nbytes
        ptrs = [a for a in addresses if a is not None]
        codes = self._store.batch_upsert_from(names, ptrs, sizes)
        for code in codes:
            if code != NO_AVAILABLE_HANDLE:
                self._check("upsert_from", code)
        return [code == 0 for code in codes]

    vectored_get = True
    streamed_get = False  # measured: a call costs ~0.35 ms, so sub-batches small enough to
    # verify in cache cost more than they save; chunks are verified on a worker thread instead
    # a scatter read's sub-batches, each reported to `landed` (verified as it lands): as
    # large as the store's default chunk, since each call pays a fixed cost (~3.6 ms over TCP
    # between hosts: 16 MiB calls held cross-host loads at 0.67 of one call)
    stream_bytes = 64 << 20

    async def get_parts_many(
        self,
        keys: Sequence[bytes],
        targets: Sequence[Sequence[memoryview]],
        *,
        landed: Landed | None = None,
    ) -> list[int]:
        """Scatter each object into its targets (header buffer, then the host page's chunks)
        with `batch_get_into_multi_buffers`: one copy, from the store into the host page.
        Every target must lie in registered memory (the host tier registers its pools).
        With `landed`, the batch is read in sub-batches of about `stream_bytes`, each
        reported as it lands (so it is verified while in the CPU's cache)."""
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        for target in targets:
            addresses = [self._address(t) for t in target]
            if any(a is None for a in addresses):
                raise TierUnavailableError(
                    "mooncake scatter read into memory that is not registered "
                    "(register the host pools with register_memory)"
                )
            ptrs.append([a for a in addresses if a is not None])
            sizes.append([t.nbytes for t in target])
        names = self._names(keys)
        step = [len(names)] if landed is None else []
        if landed is not None:
            count = total = 0
            for size in sizes:
                count, total = count + 1, total + sum(size)
                if total >= self.stream_bytes:
                    step.append(count)
                    count = total = 0
            if count:
                step.append(count)

        def read() -> list[int]:
            out: list[int] = []
            start = 0
            for count in step:
                end = start + count
                got = self._store.batch_get_into_multi_buffers(
                    names[start:end], ptrs[start:end], sizes[start:end]
                )
                counts = self._counts(names[start:end], got, sizes[start:end])
                out += counts
                if landed is not None:
                    landed(start, counts)
                start = end
            return out

        return await self._run("get_into", read)

    def _counts(self, names: list[str], got: list[int], sizes: list[list[int]]) -> list[int]:
        """A scatter read's codes as counts (on the client's thread)."""
        unsure = [i for i, n in enumerate(got) if n in AMBIGUOUS]
        stored_sizes: dict[int, int] = {}
        if unsure:  # a metadata query, no transfer: only on this error path
            stored_sizes = {i: int(self._store.get_size(names[i])) for i in unsure}
        out = []
        for i, n in enumerate(got):
            if n >= 0:
                out.append(n)
            elif n in ABSENT:
                out.append(MISSING)
            elif i in stored_sizes:
                out.append(self._resolve(stored_sizes[i], sum(sizes[i])))
            else:
                out.append(FAILED)
        return out

    @staticmethod
    def _resolve(stored: int, wanted: int) -> int:
        """An ambiguous read code, given `get_size`'s answer for the object."""
        if stored >= 0:
            # another size is definitely not ours (0 bytes: the store deletes it); the same
            # size means the transfer itself failed
            return 0 if stored != wanted else FAILED
        return MISSING if stored in ABSENT else FAILED

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        names = self._names(keys)
        values = await self._run("get", lambda: self._store.get_batch(names))
        out = [bytes(v) if v else None for v in values]
        empty = [name for name, v in zip(names, out, strict=True) if v is None]
        if empty:  # absent, or the call failed: get_batch answers both with an empty value
            flags = await self._run("get", lambda: self._store.batch_is_exist(empty))
            for name, flag in zip(empty, flags, strict=True):
                if flag != 0:
                    raise TierUnavailableError(
                        f"mooncake get at {self.master_address}: {name} came back empty but "
                        f"batch_is_exist says {flag} (1 present, negative an error)"
                    )
        return out

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        names = self._names(keys)
        flags = await self._run("exists", lambda: self._store.batch_is_exist(names))
        for flag in flags:
            self._check("exists", flag)
        return [flag == 1 for flag in flags]

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        names = self._names(keys)
        codes = await self._run("remove", lambda: self._store.batch_remove(names, True))
        for code in codes if isinstance(codes, list) else [codes]:  # a count on older wheels
            if code not in ABSENT and code != OBJECT_HAS_LEASE:
                self._check("remove", code)

    async def close(self) -> None:
        bases = [base for base, _, _ in self._registered]

        def unregister() -> None:
            for base in bases:
                self._store.unregister_buffer(base)

        await self._run("unregister", unregister)
        self._registered.clear()
        await self._run("close", self._store.close)
        self._executor.shutdown(wait=True)
