"""Cross-host L3 load throughput (issue #17): host B loading a hit that host A stored, over a
veth pair between two network namespaces (`hicache.testing.netns_hosts.TwoHosts`), through
hicache vs. the backend's own client moving the same bytes in the same run.

hicache's side is the store layer's batch fetch, `GuardedStore.fetch_into` (object header,
xxh3-64 verification, chunking, byte-scaled timeouts, breaker), into preallocated host pages:
that is what B's sidecar runs for a cross-host hit, and the layer the network is under. The
sidecar's end-to-end load adds host-to-device copies that do not cross the veth (measured by
benchmarks/sidecar.py and benchmarks/transfer.py), so it would dilute the comparison.

- mooncake: a mooncake_master in A's namespace bound to A's address; A's client (its global
  segment the only one while it writes, so every object lies there) stores 256 pages of 1 MiB
  twice: through `GuardedStore.put` (ours) and by `batch_upsert_from` (raw, no header). Then
  B's client joins (its own address, a small segment) and reads both sets over the veth,
  interleaved trial by trial (the order rotates): ours by `fetch_into` (the kind's default
  chunks, 64 MiB for Mooncake, and one chunk for the whole batch), raw by `batch_get_into`
  straight into the same registered host pages on the same worker thread as ours (the
  backend's own), in one call and in calls of the default chunk.
- redis_cluster: the same with Redis Cluster nodes in A's namespace (`RedisClusterServers`)
  and `storage.kind: redis` with a `redis+cluster://` URL; raw: redis-py's asyncio cluster
  client (the backend's own for reads), pipelines of GETs (one, and one per default chunk),
  each reply copied into its host page. Skipped with one line while
  `hicache.testing.local_servers` has no `RedisClusterServers`.

Every trial checks the host pages hold the payloads. Figures: best of TRIALS on each side
(GB/s), `cluster_load_ratio_<kind>` = best raw seconds (the faster raw way) / best ours
seconds (= ours GB/s / raw GB/s), the median of the per-trial ratios and the fraction of
trials above 1. Ours makes the raw side's transfer and more, so
a ratio above 1 means the measurement is wrong. veth is in-kernel: the GB/s are bound by the
machine's memory and CPUs, not by a NIC.

    sudo python benchmarks/cluster.py     # needs root (network namespaces); last line: JSON
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from hicache.config.schema import MooncakeStorage, RedisStorage
from hicache.storage import GuardedStore
from hicache.testing import local_servers, netns_hosts
from hicache.testing.netns_hosts import TwoHosts

PAGES, PAGE_BYTES, TRIALS = 256, 1 << 20, 15
# what a deployment of each kind cuts L3 batches into (`storage.chunk_bytes` defaults)
MOONCAKE_CHUNK = int(MooncakeStorage.model_fields["chunk_bytes"].default)
REDIS_CHUNK = int(RedisStorage.model_fields["chunk_bytes"].default)
Op = Callable[[], Awaitable[object]]


class Pages:
    """The payloads (one source buffer, random bytes) and the host pages both sides land in."""

    def __init__(self) -> None:
        self.source = np.frombuffer(os.urandom(PAGES * PAGE_BYTES), dtype=np.uint8).copy()
        self.host = np.zeros(PAGES * PAGE_BYTES, dtype=np.uint8)
        self.host[:] = 1  # prefaulted, as the host pools are
        self.keys = [i.to_bytes(16, "little") for i in range(PAGES)]
        self.raw_names = [f"raw:{k.hex()}" for k in self.keys]
        self.payloads = [self.page(self.source, i) for i in range(PAGES)]
        self.targets = [self.page(self.host, i) for i in range(PAGES)]

    @staticmethod
    def page(array: np.ndarray[Any, np.dtype[np.uint8]], i: int) -> memoryview:
        return memoryview(array[i * PAGE_BYTES : (i + 1) * PAGE_BYTES].data).cast("B")

    @staticmethod
    def address(array: np.ndarray[Any, np.dtype[np.uint8]], i: int) -> int:
        return int(array.ctypes.data) + i * PAGE_BYTES

    def scrub(self) -> None:
        self.host[::4096] = 0  # a read that lands nothing fails the check

    def check_host(self, side: str) -> None:
        if not np.array_equal(self.host, self.source):
            raise AssertionError(f"{side}: the host pages do not hold the payloads after a read")


async def compare(
    kind: str, pages: Pages, ours: dict[str, Op], raw: Op, raw_chunked: Op
) -> dict[str, Any]:
    """Interleaved trials of B's reads (each of ours, by its chunk size; raw in one call and
    raw in calls of the store's default chunk; the order rotates per trial); best-of and
    per-trial figures. Ours is compared with the faster raw way (best of either; per trial,
    the faster of the trial's two): Mooncake's client is fastest in one call, redis-py's
    cluster pipeline in 16 MiB ones (one 256 MiB pipeline of replies reads far slower)."""
    sides: dict[str, Op] = {**ours, "raw": raw, "raw_chunked": raw_chunked}
    for side, op in sides.items():  # warm: connections, first touches
        pages.scrub()
        await op()
        pages.check_host(side)
    times: dict[str, list[float]] = {side: [] for side in sides}
    order = list(sides)
    for trial in range(TRIALS):
        for side in order[trial % len(order) :] + order[: trial % len(order)]:
            pages.scrub()
            started = time.perf_counter()
            await sides[side]()
            times[side].append(time.perf_counter() - started)
            pages.check_host(side)
    gb = PAGES * PAGE_BYTES / 1e9
    fastest_raw = [min(a, b) for a, b in zip(times["raw"], times["raw_chunked"], strict=True)]
    out: dict[str, Any] = {
        f"cluster_load_{kind}_raw_gbps": round(gb / min(fastest_raw), 3),
        f"cluster_load_{kind}_raw_one_call_gbps": round(gb / min(times["raw"]), 3),
        f"cluster_load_{kind}_raw_chunked_gbps": round(gb / min(times["raw_chunked"]), 3),
    }
    for side in ours:
        suffix = "" if side == "default" else f"_{side}"
        per_trial = [r / o for r, o in zip(fastest_raw, times[side], strict=True)]
        out |= {
            f"cluster_load_ratio_{kind}{suffix}": round(min(fastest_raw) / min(times[side]), 3),
            f"cluster_load_ratio_{kind}{suffix}_median_trial": round(
                statistics.median(per_trial), 3
            ),
            f"cluster_load_{kind}{suffix}_trials_above_1": round(
                sum(r > 1 for r in per_trial) / TRIALS, 3
            ),
            f"cluster_load_{kind}{suffix}_gbps": round(gb / min(times[side]), 3),
        }
    return out


def ours_by_chunk(backend: Any, pages: Pages, chunk_bytes: int) -> dict[str, Op]:
    """`fetch_into` of every page through a `GuardedStore` cutting the batch into calls of
    its kind's default chunk (`default`: what a deployment gets unless `storage.chunk_bytes`
    says otherwise), and of one chunk for the whole batch (`one_chunk`)."""
    targets = [[t] for t in pages.targets]
    stores = {
        "default": GuardedStore(backend, base_timeout_s=60, chunk_bytes=chunk_bytes),
        "one_chunk": GuardedStore(backend, base_timeout_s=60, chunk_bytes=2 * PAGES * PAGE_BYTES),
    }

    def fetch(store: GuardedStore) -> Op:
        async def ours() -> None:
            ok, _ = await store.fetch_into(pages.keys, targets)
            assert all(ok), "B: a page A stored did not come back through fetch_into"

        return ours

    return {name: fetch(store) for name, store in stores.items()}


def bench_mooncake(hosts: TwoHosts, pages: Pages) -> dict[str, Any]:
    from hicache.storage.mooncake_backend import MooncakeBackend

    master = local_servers.MooncakeMaster(
        host=hosts.address["a"], command_prefix=hosts.command_prefix("a")
    )
    master.start()
    writer: MooncakeBackend | None = None
    try:
        # A: the only segment while it writes, twice the pages and headers
        writer = hosts.within(
            "a",
            lambda: MooncakeBackend(
                master.address,
                local_hostname=hosts.address["a"],
                global_segment_bytes=3 * PAGES * PAGE_BYTES,
                local_buffer_bytes=64 << 20,
            ),
        )
        a = writer

        async def write() -> None:
            a.register_memory(memoryview(pages.source.data))
            store = GuardedStore(a, base_timeout_s=60)
            stored = await store.put(list(zip(pages.keys, pages.payloads, strict=True)))
            assert all(stored), "A: a page was not stored through GuardedStore.put"
            sources = [pages.address(pages.source, i) for i in range(PAGES)]
            codes = await a._run(
                "raw put",
                lambda: a._store.batch_upsert_from(pages.raw_names, sources, [PAGE_BYTES] * PAGES),
            )
            assert all(c == 0 for c in codes), f"A: batch_upsert_from answered {set(codes)}"

        hosts.within("a", lambda: asyncio.run(write()))

        async def read() -> dict[str, Any]:
            b = await asyncio.to_thread(
                MooncakeBackend,
                master.address,
                local_hostname=hosts.address["b"],
                global_segment_bytes=16 << 20,
                local_buffer_bytes=64 << 20,
            )
            b.register_memory(memoryview(pages.host.data))  # as the host tier registers its pools
            addresses = [pages.address(pages.host, i) for i in range(PAGES)]

            def get_into(start: int, end: int) -> None:
                got = b._store.batch_get_into(
                    pages.raw_names[start:end], addresses[start:end], [PAGE_BYTES] * (end - start)
                )
                assert all(n == PAGE_BYTES for n in got), f"B: batch_get_into answered {set(got)}"

            async def raw() -> None:
                await b._run("raw get", lambda: get_into(0, PAGES))

            async def raw_chunked() -> None:
                step = MOONCAKE_CHUNK // PAGE_BYTES

                def calls() -> None:
                    for start in range(0, PAGES, step):
                        get_into(start, min(start + step, PAGES))

                await b._run("raw get", calls)

            try:
                return await compare(
                    "mooncake", pages, ours_by_chunk(b, pages, MOONCAKE_CHUNK), raw, raw_chunked
                )
            finally:
                await b.close()

        return hosts.within("b", lambda: asyncio.run(read()))
    finally:
        if writer is not None:
            w = writer
            hosts.within("a", lambda: asyncio.run(w.close()))
        master.stop()


def bench_redis_cluster(hosts: TwoHosts, pages: Pages, workdir: Path) -> dict[str, Any]:
    make = getattr(local_servers, "RedisClusterServers", None)
    if make is None:
        raise LookupError(
            "Redis Cluster backend not merged yet (hicache.testing.local_servers has no "
            "RedisClusterServers)"
        )
    from urllib.parse import urlsplit

    from redis.asyncio.cluster import RedisCluster

    from hicache.assembly import storage_backend as make_backend
    from hicache.config.schema import RedisStorage

    servers = make(workdir, host=hosts.address["a"], command_prefix=hosts.command_prefix("a"))
    hosts.within("a", servers.start)  # its readiness probes, if any, from A's namespace
    try:
        section = RedisStorage.model_validate({"kind": "redis", "url": servers.seed_url})
        seed = urlsplit(servers.seed_url)
        if seed.hostname is None or seed.port is None:
            raise ValueError(f"RedisClusterServers.url {servers.seed_url!r} names no host:port")

        async def write() -> None:
            backend = make_backend(section)
            assert backend is not None
            raw = RedisCluster(host=seed.hostname, port=seed.port)
            try:
                stored = await GuardedStore(backend, base_timeout_s=60).put(
                    list(zip(pages.keys, pages.payloads, strict=True))
                )
                assert all(stored), "A: a page was not stored through GuardedStore.put"
                pipe = raw.pipeline()
                for name, payload in zip(pages.raw_names, pages.payloads, strict=True):
                    pipe.set(name, bytes(payload))
                await pipe.execute()
            finally:
                await raw.aclose()
                await backend.close()

        hosts.within("a", lambda: asyncio.run(write()))

        async def read() -> dict[str, Any]:
            backend = make_backend(section)
            assert backend is not None
            raw = RedisCluster(host=seed.hostname, port=seed.port)

            async def get(start: int, end: int) -> None:
                pipe = raw.pipeline()
                for name in pages.raw_names[start:end]:
                    pipe.get(name)
                values = await pipe.execute()
                for target, value in zip(pages.targets[start:end], values, strict=True):
                    target[:] = value

            async def raw_get() -> None:
                await get(0, PAGES)

            async def raw_chunked() -> None:
                step = REDIS_CHUNK // PAGE_BYTES
                for start in range(0, PAGES, step):
                    await get(start, min(start + step, PAGES))

            try:
                return await compare(
                    "redis_cluster",
                    pages,
                    ours_by_chunk(backend, pages, REDIS_CHUNK),
                    raw_get,
                    raw_chunked,
                )
            finally:
                await raw.aclose()
                await backend.close()

        return hosts.within("b", lambda: asyncio.run(read()))
    finally:
        servers.stop()


def main() -> dict[str, Any]:
    why_not = netns_hosts.available()
    if why_not is not None:
        sys.exit(f"benchmarks/cluster.py needs two network namespaces: {why_not}")
    results: dict[str, Any] = {"pages": PAGES, "page_bytes": PAGE_BYTES, "trials": TRIALS}
    pages = Pages()
    with TwoHosts() as hosts, tempfile.TemporaryDirectory() as tmp:
        results["hosts"] = dict(hosts.address)
        benches: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("mooncake", lambda: bench_mooncake(hosts, pages)),
            ("redis_cluster", lambda: bench_redis_cluster(hosts, pages, Path(tmp))),
        ]
        for kind, bench in benches:
            try:
                r = bench()
            except (FileNotFoundError, ImportError, LookupError) as exc:
                results[f"{kind}_skipped"] = str(exc)
                print(f"{kind:>13}: skipped ({exc})", flush=True)
                continue
            results.update(r)
            for suffix, what in (("", "default chunk"), ("_one_chunk", "one chunk")):
                print(
                    f"cluster_load_ratio_{kind}{suffix}={r[f'cluster_load_ratio_{kind}{suffix}']} "
                    f"(ours, {what}: {r[f'cluster_load_{kind}{suffix}_gbps']} GB/s; raw "
                    f"{r[f'cluster_load_{kind}_raw_gbps']} GB/s; median per-trial ratio "
                    f"{r[f'cluster_load_ratio_{kind}{suffix}_median_trial']})",
                    flush=True,
                )
            print(
                f"{kind} raw: {r[f'cluster_load_{kind}_raw_one_call_gbps']} GB/s in one call, "
                f"{r[f'cluster_load_{kind}_raw_chunked_gbps']} GB/s in calls of the default chunk",
                flush=True,
            )
    return results


if __name__ == "__main__":
    print(json.dumps(main()))
