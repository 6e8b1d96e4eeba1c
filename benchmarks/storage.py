"""L3 persist / fetch through our path vs the backend's own client, measured in one run.

For each backend: 256 pages of 1 MiB, persisted and fetched through `GuardedStore` (object
header, xxh3 checksum, byte-scaled timeout, circuit breaker, verification on read; a fetch
ends with every payload in a preallocated "host page", as TieredCache's does) and, in the
same run, with the backend's own client doing the plain batched put / get of the same bytes
(file: plain writes, and reads into one preallocated buffer; redis: a redis-py pipeline;
mooncake: upsert_batch / get_batch). ratio = our GB/s / raw GB/s. Real servers are started on
loopback (redis-server, mooncake_master) and stopped after; a backend whose server is not
installed is reported as skipped.

    python benchmarks/storage.py        # last line: one JSON object
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from hicache.scheduler import run
from hicache.storage import FileBackend, GuardedStore
from hicache.storage.backend import StorageBackend
from hicache.storage.local_servers import MooncakeMaster, RedisServer

PAGES, PAGE_BYTES, TRIALS = 256, 1 << 20, 5


def payloads() -> list[tuple[bytes, bytes]]:
    return [(i.to_bytes(16, "little"), os.urandom(PAGE_BYTES)) for i in range(PAGES)]


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


async def fetch_into(store: GuardedStore, keys: list[bytes], host: bytearray) -> None:
    """Our get as TieredCache runs it: each payload delivered into its host page and verified
    there (file: readv, mooncake: batch_get_into_multi_buffers, both straight into the page;
    redis: the client's bytes, then one copy)."""
    view = memoryview(host)
    targets = [[view[i * PAGE_BYTES : (i + 1) * PAGE_BYTES]] for i in range(len(keys))]
    ok, _ = await store.fetch_into(keys, targets)
    assert all(ok), "a persisted page did not come back"


async def compare(
    name: str,
    backend: StorageBackend,
    raw_put: Callable[[list[tuple[bytes, bytes]]], Awaitable[object]],
    raw_get: Callable[[list[bytes]], Awaitable[object]],
) -> dict[str, float]:
    store = GuardedStore(backend, base_timeout_s=30)
    items = payloads()
    host = bytearray(PAGES * PAGE_BYTES)  # stands for the host pool's pages, prefaulted
    host[:] = b"\0" * len(host)
    backend.register_memory(memoryview(host))  # as TieredCache registers its host pools
    keys = [k for k, _ in items]
    ours_put, ours_get, base_put, base_get = [], [], [], []
    for _ in range(TRIALS):  # alternate, so drift hits both sides alike
        base_put.append(await timed(lambda: raw_put(items)))
        base_get.append(await timed(lambda: raw_get(keys)))
        ours_put.append(await timed(lambda: store.put(items)))
        await fetch_into(store, keys, host)  # warm (first-touch of the fetch arena)
        ours_get.append(await timed(lambda: fetch_into(store, keys, host)))
    med = statistics.median
    gb = PAGES * PAGE_BYTES / 1e9
    out = {
        f"{name}_put_ratio": round(med(base_put) / med(ours_put), 3),
        f"{name}_get_ratio": round(med(base_get) / med(ours_get), 3),
        f"{name}_put_gbps": round(gb / med(ours_put), 2),
        f"{name}_get_gbps": round(gb / med(ours_get), 2),
        f"{name}_raw_put_gbps": round(gb / med(base_put), 2),
        f"{name}_raw_get_gbps": round(gb / med(base_get), 2),
    }
    await backend.close()
    return out


async def bench_file(root: Path) -> dict[str, float]:
    raw_dir = root / "raw"
    raw_dir.mkdir()

    def write(items: list[tuple[bytes, bytes]]) -> None:
        for key, data in items:
            tmp = raw_dir / f"{key.hex()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, raw_dir / key.hex())

    # the plain read at its best: into one preallocated buffer (read_bytes allocates per file,
    # and its speed then swings 1.4-6 GB/s with the allocator's state, not with the disk)
    landing = bytearray(PAGES * PAGE_BYTES)
    landing[:] = b"\0" * len(landing)

    def read(keys: list[bytes]) -> None:
        view = memoryview(landing)
        for i, k in enumerate(keys):
            with open(raw_dir / k.hex(), "rb", buffering=0) as f:
                f.readinto(view[i * PAGE_BYTES : (i + 1) * PAGE_BYTES])

    return await compare(
        "file",
        FileBackend(root / "ours", capacity_bytes=4 * PAGES * PAGE_BYTES),
        lambda items: asyncio.to_thread(write, items),
        lambda keys: asyncio.to_thread(read, keys),
    )


async def bench_redis(root: Path) -> dict[str, float]:
    import redis

    from hicache.storage.redis_backend import RedisBackend

    server = RedisServer(root)
    server.start()
    try:
        client = redis.Redis.from_url(server.url)

        def put(items: list[tuple[bytes, bytes]]) -> None:
            pipe = client.pipeline(transaction=False)
            for key, data in items:
                pipe.set(b"raw:" + key, data)
            pipe.execute()

        def get(keys: list[bytes]) -> None:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(b"raw:" + key)
            pipe.execute()

        result = await compare(
            "redis",
            RedisBackend(server.url, socket_timeout_s=30),
            lambda items: asyncio.to_thread(put, items),
            lambda keys: asyncio.to_thread(get, keys),
        )
        client.close()
        return result
    finally:
        server.stop()


async def bench_mooncake() -> dict[str, float]:
    from hicache.storage.mooncake_backend import MooncakeBackend

    master = MooncakeMaster()
    master.start()
    try:
        size = 3 * PAGES * PAGE_BYTES
        ours = await asyncio.to_thread(
            MooncakeBackend, master.address, global_segment_bytes=size, local_buffer_bytes=size
        )
        raw = ours._store  # the same client, called directly: the backend's own batched API

        async def put(items: list[tuple[bytes, bytes]]) -> None:
            names = [f"raw:{k.hex()}" for k, _ in items]
            await asyncio.to_thread(raw.upsert_batch, names, [d for _, d in items])

        async def get(keys: list[bytes]) -> None:
            await asyncio.to_thread(raw.get_batch, [f"raw:{k.hex()}" for k in keys])

        return await compare("mooncake", ours, put, get)
    finally:
        master.stop()


async def main() -> dict[str, object]:
    results: dict[str, object] = {"pages": PAGES, "page_bytes": PAGE_BYTES}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, bench in (
            ("file", lambda: bench_file(root)),
            ("redis", lambda: bench_redis(root)),
            ("mooncake", bench_mooncake),
        ):
            try:
                r = await bench()
            except (FileNotFoundError, ImportError) as exc:
                results[f"{name}_skipped"] = str(exc)
                print(f"{name:>9}: skipped ({exc})")
                continue
            results.update(r)
            print(
                f"{name:>9}: put {r[f'{name}_put_ratio']:.2f} of raw ({r[f'{name}_put_gbps']} "
                f"GB/s), get {r[f'{name}_get_ratio']:.2f} of raw ({r[f'{name}_get_gbps']} GB/s)"
            )
    return results


if __name__ == "__main__":
    print(json.dumps(run(main())))
