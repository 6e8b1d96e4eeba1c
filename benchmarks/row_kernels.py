"""The candidate CPU row kernels side by side, each as a ratio to a memcpy of the same bytes.

This is the measurement behind `hicache/transfer/rows.py`'s choice of kernel per case (see
docs/design.md, "CPU row kernels"). Llama-8B rows (8 KV heads x 128, bf16: 2 KiB per token);
one tensor of 32 MiB per op; random device rows (4x as many as moved) against a run of host
rows, packed (layer_first) or strided (page_first: here 8 rows apart, as 4 layers of K and V
would be). Each trial times a memcpy right before each kernel; a figure is the median of the
per-trial ratios. Runs on the calling thread with one torch thread.

    python benchmarks/row_kernels.py [--trials 9]

The last line is one JSON object: {"<layout>_<kernel>_p<tokens>": ratio, ...}.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from hicache.memory.hugepages import advise_hugepages

TOKEN_BYTES = 8 * 128 * 2
MOVE_BYTES = 32 * 2**20
STRIDE_ROWS = 8


def buffer(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    advise_hugepages(t)
    return t.fill_(1)


def items(rows: torch.Tensor) -> np.ndarray:
    array = rows.numpy()
    return array.view(np.dtype((np.void, array.shape[1])))[:, 0]


def kernels(
    device: torch.Tensor, host: torch.Tensor, gather_ids: list[int], scatter_ids: list[int]
) -> dict[str, Callable[[], None]]:
    """Gathers (device rows -> host run, a backup) and scatters (host run -> device rows, a
    load), each kernel as rows.py would call it."""
    g_idx, s_idx = torch.tensor(gather_ids), torch.tensor(scatter_ids)
    g_np, s_np = g_idx.numpy(), s_idx.numpy()
    dev_items, host_items = items(device), items(host)
    wide_dev, wide_host = device.view(torch.int64), host.view(torch.int64)
    row = host.shape[1]
    dev_at, host_at, host_step = device.data_ptr(), host.data_ptr(), host.stride(0)

    def gather_memcpy_per_row() -> None:
        for i, r in enumerate(gather_ids):
            ctypes.memmove(host_at + i * host_step, dev_at + r * row, row)

    return {
        "gather_index_select": lambda: torch.index_select(wide_dev, 0, g_idx, out=wide_host),
        "gather_np_take": lambda: np.take(dev_items, g_np, out=host_items, mode="clip"),
        "gather_memcpy_per_row": gather_memcpy_per_row,
        "scatter_np_put": lambda: np.put(dev_items, s_np, host_items, mode="clip"),
        "scatter_np_assign": lambda: dev_items.__setitem__(s_np, host_items),
        "scatter_index_copy": lambda: wide_dev.index_copy_(0, s_idx, wide_host),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--pages", default="1,16,64,256")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, float] = {}
    base_src, base_dst = buffer(MOVE_BYTES), buffer(MOVE_BYTES)

    def memcpy() -> None:
        ctypes.memmove(base_dst.data_ptr(), base_src.data_ptr(), MOVE_BYTES)

    for layout in ("layer_first", "page_first"):
        print(f"== {layout} host rows (ratio to memcpy of the same bytes)")
        for page in (int(p) for p in args.pages.split(",")):
            row = page * TOKEN_BYTES
            n = MOVE_BYTES // row
            device = buffer(4 * n * row).view(4 * n, row)
            step = row * (STRIDE_ROWS if layout == "page_first" else 1)
            host = buffer(n * step).as_strided((n, row), (step, 1))
            rng = random.Random(page)
            gather_ids = sorted(rng.sample(range(4 * n), n))
            scatter_ids = rng.sample(range(4 * n), n)
            runs = kernels(device, host, gather_ids, scatter_ids)
            ratios: dict[str, list[float]] = {name: [] for name in runs}
            for trial in range(args.trials + 1):  # the first round warms up
                for name, kernel in runs.items():
                    start = time.perf_counter()
                    memcpy()
                    base = time.perf_counter() - start
                    start = time.perf_counter()
                    kernel()
                    ours = time.perf_counter() - start
                    if trial:
                        ratios[name].append(base / ours)
            line = []
            for name, values in ratios.items():
                ratio = round(statistics.median(values), 2)
                results[f"{layout}_{name}_p{page}"] = ratio
                line.append(f"{name} {ratio:.2f}")
            print(f"p{page:<4} " + "  ".join(line))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
