"""`hicache demo`, for now a round trip on the embedded defaults (the trace-replay demo with
tiers, progress and the full summary is issue 7).

Lifecycle: build the embedded stack from the deployment (device pool, host tier, scheduler),
"prefill" a prefix with bytes derived from its token ids, back it up to L2, wipe the device,
load it back into other device pages layer by layer (the consumer waits on each layer), and
verify every byte the load says it moved. Returns non-zero on any mismatch.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import torch

from hicache.config import LoadedConfig, format_bytes
from hicache.embedded import EmbeddedCache
from hicache.scheduler import GroupPages, OpHandle, loop_name, run


@dataclass(frozen=True, slots=True)
class DemoSummary:
    prefix_tokens: int
    bytes_backed_up: int
    bytes_loaded: int
    load_gbps: float
    stall_ms: float
    bytes_verified: int
    mismatches: int


def _fill_from_tokens(cache: EmbeddedCache, pages: dict[str, list[int]], seed: int) -> None:
    """Deterministic content per (group, page, layer, tensor): what a prefill would write."""
    for name, page_ids in pages.items():
        pool = cache.device_pools[name]
        for local_id in range(pool.geometry.num_layers):
            for tensor_rows in pool.layer_rows(local_id):
                for page in page_ids:
                    gen = torch.Generator().manual_seed(hash((seed, name, local_id, page)) & 0xFFFF)
                    row = tensor_rows[page]
                    row.copy_(torch.randint(0, 256, row.shape, dtype=torch.uint8, generator=gen))


def _consume(handle: OpHandle, layer_ids: range) -> None:
    """The engine's forward: wait for each layer before its attention."""
    for layer_id in layer_ids:
        handle.wait_layer(layer_id)


async def _round_trip(cache: EmbeddedCache) -> DemoSummary:
    page_size = next(iter(cache.geometries.values())).page_size_tokens
    rng = random.Random(0)
    device_pages = min(p.num_pages for p in cache.device_pools.values())
    host_pages = min(p.num_pages for p in cache.host_tier.pools.values())
    n = max(1, min(device_pages // 2, host_pages, 64))
    src = {name: sorted(rng.sample(range(device_pages), n)) for name in cache.device_pools}
    for name, geom in cache.geometries.items():
        if not geom.group.kind.is_token_cache:
            src[name] = src[name][:1]  # a state group keeps one snapshot
    _fill_from_tokens(cache, src, seed=1)
    # expected bytes per (group, tensor-row view, position in the prefix)
    want = {
        (name, r, i): rows[page].clone()
        for name, pages in src.items()
        for r, rows in enumerate(_all_rows(cache, name))
        for i, page in enumerate(pages)
    }
    async with cache.scheduler.running() as sched:
        stored = await (
            await sched.backup({k: GroupPages(tuple(v)) for k, v in src.items()})
        ).done()
        if not stored.ok:
            raise RuntimeError(f"backup failed: {stored.error}")
        for pool in cache.device_pools.values():  # the engine reuses its device pages
            for layer in pool.tensors:
                for t in layer.values():
                    t.zero_()
        dst = {  # other device pages than the prefix came from
            name: [p for p in range(device_pages) if p not in pages][: len(pages)]
            for name, pages in src.items()
        }
        request = {
            name: GroupPages(tuple(dst[name]), stored.groups[name].host_pages) for name in src
        }
        started = time.perf_counter()
        handle = await sched.load(request)
        consumer = threading.Thread(target=_consume, args=(handle, sched.layer_map.stage_layer_ids))
        consumer.start()
        loaded = await handle.done()
        consumer.join()
        elapsed = time.perf_counter() - started
        stats = sched.stats()
    verified = mismatches = 0
    for name, pages in dst.items():
        moved = set(loaded.groups[name].moved_device_pages)
        for r, rows in enumerate(_all_rows(cache, name)):
            for i, page in enumerate(pages):
                if page in moved:
                    expected = want[(name, r, i)]
                    verified += expected.numel()
                    mismatches += int(not torch.equal(rows[page], expected))
    return DemoSummary(
        prefix_tokens=n * page_size,
        bytes_backed_up=stored.bytes_moved,
        bytes_loaded=loaded.bytes_moved,
        load_gbps=loaded.bytes_moved / elapsed / 1e9 if elapsed else 0.0,
        stall_ms=stats.total_stall_s * 1e3,
        bytes_verified=verified,
        mismatches=mismatches,
    )


def _all_rows(cache: EmbeddedCache, group: str) -> list[torch.Tensor]:
    pool = cache.device_pools[group]
    return [rows for i in range(pool.geometry.num_layers) for rows in pool.layer_rows(i)]


def run_demo(loaded: LoadedConfig) -> int:
    cache = EmbeddedCache.from_config(loaded)
    try:
        print("\n== embedded stack")
        for name, pool in cache.device_pools.items():
            print(f"device pool {name!r}: {pool.num_pages} pages, {format_bytes(pool.nbytes)}")
        for line in cache.host_tier.report.lines():
            print(line)
        summary = run(_round_trip(cache))
    finally:
        cache.close()
    print(
        f"\n== round trip ({loop_name()}): back up a {summary.prefix_tokens}-token prefix, "
        "load it back layer by layer"
    )
    print(
        f"backed up {format_bytes(summary.bytes_backed_up)}, loaded "
        f"{format_bytes(summary.bytes_loaded)} at {summary.load_gbps:.2f} GB/s, "
        f"consumer stall {summary.stall_ms:.2f} ms"
    )
    print(f"bytes verified: {summary.bytes_verified}, mismatches: {summary.mismatches}")
    return 1 if summary.mismatches else 0
