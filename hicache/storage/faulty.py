"""`FaultyBackend`: wraps any backend and injects latency, a bandwidth limit, dropped
writes, corrupted reads and failures after N calls — deterministic (seeded), for tests of
everything that must survive a bad L3. Shipped in the package, like the fake copy backend."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

from hicache.errors import TierUnavailableError
from hicache.storage.backend import Buffer, StorageBackend


class FaultyBackend(StorageBackend):
    name = "faulty"

    def __init__(
        self,
        inner: StorageBackend,
        *,
        latency_s: float = 0.0,
        bandwidth_bytes_per_s: float | None = None,
        drop_rate: float = 0.0,
        corrupt_rate: float = 0.0,
        fail_after: int | None = None,
        seed: int = 0,
    ):
        self.inner = inner
        self.latency_s = latency_s
        self.bandwidth = bandwidth_bytes_per_s
        self.drop_rate = drop_rate
        self.corrupt_rate = corrupt_rate
        self.fail_after = fail_after
        self.calls = 0
        self.down = False
        self._rng = random.Random(seed)

    async def _enter(self, nbytes: int) -> None:
        self.calls += 1
        if self.down or (self.fail_after is not None and self.calls > self.fail_after):
            raise TierUnavailableError(f"injected: backend unavailable (call {self.calls})")
        delay = self.latency_s + (nbytes / self.bandwidth if self.bandwidth else 0.0)
        if delay:
            await asyncio.sleep(delay)

    async def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> list[bool]:
        await self._enter(sum(memoryview(d).nbytes for _, d in items))
        kept = [(k, d) for k, d in items if self._rng.random() >= self.drop_rate]
        stored = set()
        if kept:
            for (key, _), ok in zip(kept, await self.inner.put_many(kept), strict=True):
                if ok:
                    stored.add(key)
        return [key in stored for key, _ in items]

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        await self._enter(0)
        out = await self.inner.get_many(keys)
        for i, data in enumerate(out):
            if data and self._rng.random() < self.corrupt_rate:
                flipped = bytearray(data)
                flipped[len(flipped) // 2] ^= 0xFF
                out[i] = bytes(flipped)
        return out

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        await self._enter(0)
        return await self.inner.exists_many(keys)

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        await self._enter(0)
        await self.inner.delete_many(keys)
