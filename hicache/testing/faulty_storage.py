"""`FaultyBackend`: wraps any backend and injects latency, a bandwidth limit, dropped
writes, corrupted reads and failures after N calls — deterministic (seeded), for tests of
everything that must survive a bad L3. Shipped in the package, like the fake copy backend.

Scatter reads (`get_parts_many`) pass through only with `vectored=True` (and an inner backend
that has them); otherwise the store falls back to `get_many`, as before. `scatter_latency_s`
then models a read that is still landing after the caller's timeout: the inner backend reads
into private staging buffers, and a worker thread sleeps that long before it copies them into
the caller's targets (`latency_s`, by contrast, is spent on the loop before the call, where a
timeout cancels it). `scatter_landed` counts the copies made.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence

from hicache.errors import TierUnavailableError
from hicache.storage.backend import Buffer, Landed, StorageBackend


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
        vectored: bool = False,
        scatter_latency_s: float = 0.0,
    ):
        if scatter_latency_s < 0:
            raise ValueError(
                f"FaultyBackend scatter_latency_s={scatter_latency_s!r}: must be >= 0 seconds"
            )
        self.inner = inner
        self.latency_s = latency_s
        self.bandwidth = bandwidth_bytes_per_s
        self.drop_rate = drop_rate
        self.corrupt_rate = corrupt_rate
        self.fail_after = fail_after
        self.calls = 0
        self.down = False
        self.vectored_get = vectored and inner.vectored_get
        self.scatter_latency_s = scatter_latency_s
        self.scatter_landed = 0
        self._rng = random.Random(seed)

    def stop_writes(self) -> None:
        self.inner.stop_writes()

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

    async def get_parts_many(
        self,
        keys: Sequence[bytes],
        targets: Sequence[Sequence[memoryview]],
        *,
        landed: Landed | None = None,  # never given: `streamed_get` is False here
    ) -> list[int]:
        """The inner backend's scatter read, delayed by `scatter_latency_s` on a worker thread
        that writes the targets late; corrupts a landed object's last byte at `corrupt_rate`.
        Returns only once that thread is done (the store's contract for scatter reads)."""
        if not self.vectored_get:
            raise NotImplementedError(f"{self.name} over {self.inner.name}: vectored=False")
        nbytes = sum(t.nbytes for target in targets for t in target)
        await self._enter(nbytes)
        delay = self.scatter_latency_s
        if not delay:
            got = await self.inner.get_parts_many(keys, targets)
        else:
            staging = [[memoryview(bytearray(t.nbytes)) for t in target] for target in targets]
            got = await self.inner.get_parts_many(keys, staging)

            def land() -> None:
                time.sleep(delay)  # still writing after the caller's timeout
                for target, staged in zip(targets, staging, strict=True):
                    for t, s in zip(target, staged, strict=True):
                        t[:] = s
                self.scatter_landed += 1

            await asyncio.to_thread(land)
        for target, n in zip(targets, got, strict=True):
            parts = [t for t in target if t.nbytes]
            if n > 0 and parts and self._rng.random() < self.corrupt_rate:
                parts[-1][-1] ^= 0xFF
        return got

    def register_memory(self, view: memoryview) -> None:
        self.inner.register_memory(view)

    def damaged(self) -> int:
        return self.inner.damaged()

    def alloc_buffer(self, nbytes: int) -> memoryview:
        return self.inner.alloc_buffer(nbytes)

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        await self._enter(0)
        return await self.inner.exists_many(keys)

    async def delete_many(self, keys: Sequence[bytes]) -> None:
        await self._enter(0)
        await self.inner.delete_many(keys)
