"""`MooncakeBackend`: L3 on a Mooncake Store (the `mooncake-transfer-engine` wheels; the
non-CUDA one on CPU machines, which needs Debian's libibverbs1 even for TCP).

The client joins the cluster at construction (`setup`: local hostname, metadata server —
P2PHANDSHAKE needs no extra server —, segment sizes, protocol, master address). Writes use
`upsert_batch`: Mooncake's `put` on an existing key keeps the old value. Missing keys come
back as empty values. A dead master fails calls fast with negative status codes (the client
reconnects by itself when it returns); those, and any exception, are mapped to
`TierUnavailableError`. The client's calls are blocking, so they run on one worker thread of
this backend's own; the loop never blocks.

Zero copy: `alloc_buffer` returns memory registered with the client (`register_buffer`), and
the host tier registers its pools (`register_memory`), so a batch encoded in the arena is sent
with `batch_upsert_from` and a fetch scatters with `batch_get_into_multi_buffers` straight into
host pages — measured here 6-8 GB/s on loopback TCP against 1-4 GB/s for `upsert_batch` /
`get_batch`, which copy through Python bytes. Buffers from elsewhere fall back to
`upsert_batch`; `get_batch` serves plain `get`s. Registrations are released at `close`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from hicache.errors import TierUnavailableError
from hicache.storage.backend import Buffer, StorageBackend

T = TypeVar("T")
OBJECT_NOT_FOUND = -704  # Mooncake's ErrorCode for an absent key (RPC_FAIL, -900: master down)
# what a scatter read returns when the object's size differs from its targets' (seen here:
# -600 when they are smaller, -800 when larger): the object is there but is not ours
SIZE_MISMATCH = (-600, -800)


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
        names = self._names([k for k, _ in items])
        views = [memoryview(d) for _, d in items]
        addresses = [self._address(v) for v in views]
        if all(a is not None for a in addresses):
            sizes = [v.nbytes for v in views]
            ptrs = [a for a in addresses if a is not None]
            codes = await self._run(
                "upsert_from", lambda: self._store.batch_upsert_from(names, ptrs, sizes)
            )
            for code in codes:
                self._check("upsert_from", code)
            return [code == 0 for code in codes]
        values = [d for _, d in items]
        status = await self._run("upsert", lambda: self._store.upsert_batch(names, values))
        self._check("upsert", status)
        return [status == 0] * len(items)

    vectored_get = True

    async def get_parts_many(
        self, keys: Sequence[bytes], targets: Sequence[Sequence[memoryview]]
    ) -> list[int]:
        """Scatter each object into its targets (header buffer, then the host page's chunks)
        with `batch_get_into_multi_buffers`: one copy, from the store into the host page.
        Every target must lie in registered memory (the host tier registers its pools)."""
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
        got = await self._run(
            "get_into", lambda: self._store.batch_get_into_multi_buffers(names, ptrs, sizes)
        )
        out = []
        for n in got:
            if n in SIZE_MISMATCH:
                out.append(0)  # present, but not the size asked for: fails verification
                continue
            if n < 0 and n != OBJECT_NOT_FOUND:  # other errors fail the batch
                self._check("get_into", n)
            out.append(n if n > 0 else -1)
        return out

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        names = self._names(keys)
        values = await self._run("get", lambda: self._store.get_batch(names))
        return [bytes(v) if v else None for v in values]

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        names = self._names(keys)
        flags = await self._run("exists", lambda: self._store.batch_is_exist(names))
        for flag in flags:
            self._check("exists", flag)
        return [flag == 1 for flag in flags]

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        names = self._names(keys)
        await self._run("remove", lambda: self._store.batch_remove(names, True))

    async def close(self) -> None:
        bases = [base for base, _, _ in self._registered]

        def unregister() -> None:
            for base in bases:
                self._store.unregister_buffer(base)

        await self._run("unregister", unregister)
        self._registered.clear()
        await self._run("close", self._store.close)
        self._executor.shutdown(wait=True)
