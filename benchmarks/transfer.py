"""Page-granular copy speed vs. a contiguous copy of the same bytes, measured in one run.

A Llama-8B-shaped layer (8 KV heads x 128, bf16, K and V). For each page size, random device
pages are backed up to host (our path pairs them, sorted, with a run of fresh host pages, as
the scheduler does) and loaded back to random device pages (the engine's order), through the
real DevicePool / HostPool / copy backend. The baseline copies the same number of bytes
between contiguous buffers (from the same allocators), one copy per tensor, submitted to the
same backend as ours, so it runs on the same worker thread or stream: a memcpy on the CPU
(`np.copyto` of packed rows, measured level with glibc `memcpy` and ~10% faster than torch's
`copy_`), a `cudaMemcpyAsync` between device and pinned host memory on CUDA. Every trial
times a baseline right before each of ours, so each trial gives one ratio from two
neighbouring timings (the machine is shared and its speed drifts); a figure is the median
over the trials. ratio = our GB/s / baseline GB/s.

    python benchmarks/transfer.py [--device cpu|cuda] [--layout layer_first|page_first]

On CUDA it also times a per-page `cudaMemcpyAsync` loop (`vs_loop_p*` = loop time / ours).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from hicache.memory import DevicePool, GroupGeometry, HostPool
from hicache.model import CacheGroup, CacheKind, CacheSpec, KvFormat
from hicache.transfer import (
    CopyBackend,
    Direction,
    GroupMove,
    RowCopy,
    copy_layers_blocking,
    make_backend,
)

LAYER = CacheSpec(CacheKind.FULL, KvFormat.MHA, num_kv_heads=8, head_dim=128, v_head_dim=128)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def bench_page_size(
    backend: CopyBackend, page: int, layout: str, move_bytes: int, trials: int
) -> dict[str, float]:
    geometry = GroupGeometry(CacheGroup("full", LAYER, (0,)), torch.bfloat16, page)
    n = max(1, move_bytes // geometry.page_bytes)
    device = DevicePool.allocate(geometry, 4 * n, backend.device)
    host = HostPool(geometry, n, layout, backend.alloc_host(n * geometry.page_bytes))  # type: ignore[arg-type]
    for t in device.tensors[0].values():
        t.uniform_()
    rng = random.Random(page)
    backup_dev = sorted(rng.sample(range(4 * n), n))
    host_pages = host.allocator.alloc(n)
    load_dev = rng.sample(range(4 * n), n)
    backup = GroupMove.build(backend, device, host, backup_dev, host_pages)
    load = GroupMove.build(backend, device, host, load_dev, host_pages)
    row = geometry.row_bytes("k")
    # baseline buffers come from the same allocators as ours (huge pages, pinning alike)
    src = DevicePool.allocate(geometry, 2 * n, backend.device).rows(0, "k").view(2, n * row)
    src.fill_(1)
    dst = backend.alloc_host(2 * n * row).view(2, n * row)
    dst.fill_(1)

    whole = backend.rows([0], "device")  # one run: each tensor is one contiguous copy
    to_host = [RowCopy(src[i : i + 1], whole, dst[i : i + 1], whole) for i in (0, 1)]
    to_device = [RowCopy(dst[i : i + 1], whole, src[i : i + 1], whole) for i in (0, 1)]

    def baseline_d2h() -> None:
        copy_layers_blocking(backend, Direction.BACKUP, [(copy, [0]) for copy in to_host])

    def baseline_h2d() -> None:
        copy_layers_blocking(backend, Direction.LOAD, [(copy, [0]) for copy in to_device])

    runs: dict[str, list[float]] = {k: [] for k in ("backup", "load", "base_d2h", "base_h2d")}
    for _ in range(trials + 1):  # the first round warms up and is dropped
        runs["base_d2h"].append(timed(baseline_d2h, backend.device))
        runs["backup"].append(
            timed(
                lambda: copy_layers_blocking(backend, Direction.BACKUP, [(backup, [0])]),
                backend.device,
            )
        )
        runs["base_h2d"].append(timed(baseline_h2d, backend.device))
        runs["load"].append(
            timed(
                lambda: copy_layers_blocking(backend, Direction.LOAD, [(load, [0])]), backend.device
            )
        )
    med = {k: statistics.median(v[1:]) for k, v in runs.items()}

    def paired(ours: str, base: str) -> float:
        return round(
            statistics.median(b / o for b, o in zip(runs[base][1:], runs[ours][1:], strict=True)),
            3,
        )

    nbytes = 2 * n * row
    out = {
        f"backup_ratio_p{page}": paired("backup", "base_d2h"),
        f"load_ratio_p{page}": paired("load", "base_h2d"),
        f"backup_gbps_p{page}": round(nbytes / med["backup"] / 1e9, 2),
        f"load_gbps_p{page}": round(nbytes / med["load"] / 1e9, 2),
        f"baseline_gbps_p{page}": round(nbytes / med["base_h2d"] / 1e9, 2),
    }
    if backend.device.type == "cuda" and page <= 16:
        rows_dev = device.rows(0, "k")
        rows_host = host.rows(0, "k")

        def per_page_loop() -> None:
            for d, h in zip(load_dev, host_pages, strict=True):
                rows_dev[d].copy_(rows_host[h], non_blocking=True)
                device.rows(0, "v")[d].copy_(host.rows(0, "v")[h], non_blocking=True)

        loop = statistics.median(timed(per_page_loop, backend.device) for _ in range(trials))
        out[f"vs_loop_p{page}"] = round(loop / med["load"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layout", default="layer_first", choices=["layer_first", "page_first"])
    parser.add_argument("--move-mib", type=int, default=64, help="bytes per op (K and V)")
    parser.add_argument("--trials", type=int, default=11)
    parser.add_argument("--pages", default="1,16,64,256")
    args = parser.parse_args()
    torch.set_num_threads(1)
    backend = make_backend(args.device)
    results: dict[str, float | str] = {"device": args.device, "layout": args.layout}
    try:
        print(f"{'page':>5} {'backup':>8} {'load':>8}   (ratio vs contiguous copy, same run)")
        for page in (int(p) for p in args.pages.split(",")):
            r = bench_page_size(backend, page, args.layout, args.move_mib * 2**20, args.trials)
            results.update(r)
            print(
                f"{page:>5} {r[f'backup_ratio_p{page}']:>8.2f} {r[f'load_ratio_p{page}']:>8.2f}"
                f"   ({r[f'baseline_gbps_p{page}']:.1f} GB/s baseline)"
            )
    finally:
        backend.close()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
