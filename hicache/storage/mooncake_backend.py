"""`MooncakeBackend`: L3 on a Mooncake Store (the `mooncake-transfer-engine` wheels; the
non-CUDA one on CPU machines, which needs Debian's libibverbs1 even for TCP).

The client joins the cluster at construction (`setup`: local hostname, metadata server —
P2PHANDSHAKE needs no extra server —, segment sizes, protocol, master address). Writes use
`upsert_batch`: Mooncake's `put` on an existing key keeps the old value. Missing keys come
back as empty values. A dead master fails calls fast with negative status codes (the client
reconnects by itself when it returns); those, and any exception, are mapped to
`TierUnavailableError`. The client's calls are blocking, so they run on one worker thread of
this backend's own; the loop never blocks. Zero-copy `put_from` / `get_into` on registered
host buffers is not used yet (values are copied once into bytes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from hicache.errors import TierUnavailableError
from hicache.storage.backend import Buffer, StorageBackend

T = TypeVar("T")


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
        values = [d for _, d in items]
        status = await self._run("upsert", lambda: self._store.upsert_batch(names, values))
        self._check("upsert", status)
        return [status == 0] * len(items)

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
        await self._run("close", self._store.close)
        self._executor.shutdown(wait=True)
