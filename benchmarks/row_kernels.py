"""The candidate CPU row kernels side by side: speed against a memcpy of the same bytes, and
whether other Python threads can run while they copy.

This is the measurement behind `hicache/transfer/rows.py`'s choice of kernel per case (see
docs/design.md, "CPU row kernels"). Llama-8B rows (8 KV heads x 128, bf16: 2 KiB per token);
one tensor of 32 MiB per op; random device rows (4x as many as moved) against a run of host
rows (`gather_*`: a backup; `scatter_*`: a load), or, for `i2i_*` (two index sets: a load
from a churned host pool), against host rows sorted but picked from twice as many (runs of
about 2); packed (layer_first) or strided (page_first: here 8 rows apart, as 4 layers of K
and V would be). Candidates: the native C kernel (`*_native_auto`: an AVX2 loop for rows under
16 KiB, memcpy above, the one rows.py uses; `*_native_memcpy`: memcpy for every row;
`*_native_stream`: non-temporal stores), numpy and torch kernels, the numpy
two-index path staged whole (`i2i_numpy_staged_whole`, the old kernel) or in blocks of 4 MiB,
1 MiB, 256 KiB, a fancy-index temporary; and the baseline's own candidates
(`contiguous_*`). The baseline, timed right before each kernel in every trial, is the faster
of one glibc memcpy and the same bytes in 64 KiB memcpy pieces through the native kernel
(glibc streams the stores of a 32 MiB copy to DRAM, which measured slower here than cached
stores, so one memcpy alone is not the best contiguous copy; without the native kernel it is
the memcpy alone). A figure is the median of the per-trial ratios. Runs on the calling
thread with one torch thread.

`gil_free`: while the kernel runs five times on a worker thread, the share of a spinning
Python thread's usual pace that it keeps (about 1: the kernel releases the GIL; well below:
it holds it, and an engine thread or the scheduler's loop would stall behind every copy).
numpy releases it only for loops over more than 500 items, hence the `split` kernels, which
cut each row into sub-items until there are more than 500.

    python benchmarks/row_kernels.py [--trials 9]

The last line is one JSON object: {"<layout>_<kernel>_p<tokens>": ratio, ...,
"<layout>_<kernel>_p<tokens>_gil_free": share, ...}.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import random
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from hicache.memory.hugepages import advise_hugepages
from hicache.transfer import native
from hicache.transfer.rows import Rows, copy_rows_numpy, split_for, sub_items

TOKEN_BYTES = 8 * 128 * 2
MOVE_BYTES = 32 * 2**20
STRIDE_ROWS = 8


def buffer(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    advise_hugepages(t)
    return t.fill_(1)


def items(rows: torch.Tensor) -> np.ndarray:
    """`[n, row]` uint8 rows as n void items, one per row (numpy's loop then has n items)."""
    return sub_items(rows, 1)[:, 0]


def spin_rate() -> float:
    """A spinning thread's pace beside a worker that sleeps (releases the GIL): the 1.0 of
    `gil_free`, measured the same way as the kernels."""
    return gil_free(lambda: time.sleep(0.01), 1.0, reps=20)


def gil_free(kernel: Callable[[], object], free_rate: float, reps: int = 5) -> float:
    stop, count = [False], [0]

    def spin() -> None:
        while not stop[0]:
            count[0] += 1

    def work() -> None:
        for _ in range(reps):
            kernel()

    spinner = threading.Thread(target=spin)
    spinner.start()
    time.sleep(0.01)
    before, start = count[0], time.perf_counter()
    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    elapsed, spins = time.perf_counter() - start, count[0] - before
    stop[0] = True
    spinner.join()
    return spins / elapsed / free_rate


def kernels(
    device: torch.Tensor,
    host_all: torch.Tensor,
    gather_ids: list[int],
    scatter_ids: list[int],
    host_ids: list[int],
    kernel: native.NativeKernel | None,
) -> dict[str, Callable[[], object]]:
    """Gathers (device rows -> host run, a backup), scatters (host run -> device rows, a
    load) and copies between two index sets (scattered host rows -> device rows, a load from
    a churned pool), each kernel as rows.py would call it. `host_all` holds twice the rows
    moved: the runs use its first half, the index sets pick from all of it."""
    host = host_all[: len(gather_ids)]
    g_idx, s_idx = torch.tensor(gather_ids), torch.tensor(scatter_ids)
    g_np, s_np = g_idx.numpy(), s_idx.numpy()
    n, row = host.shape
    split = split_for(n, row)
    dev_items, host_items = items(device), items(host)
    dev_split, host_split = sub_items(device, split), sub_items(host, split)
    int_dev, int_host = device.view(torch.int64), host.view(torch.int64)
    float_dev, float_host = device.view(torch.float64), host.view(torch.float64)
    dev_at, host_at, host_step = device.data_ptr(), host.data_ptr(), host.stride(0)

    def gather_memcpy_per_row() -> None:
        for i, r in enumerate(gather_ids):
            ctypes.memmove(host_at + i * host_step, dev_at + r * row, row)

    out: dict[str, Callable[[], object]] = {}
    h_idx = torch.tensor(host_ids)
    h_np = h_idx.numpy()
    if kernel is not None:
        copy, h_step, h_ptr = kernel.copy, host.stride(0), h_idx.data_ptr()
        g_ptr, s_ptr = g_idx.data_ptr(), s_idx.data_ptr()
        for mode, label in ((0, "auto"), (1, "stream"), (2, "memcpy")):
            out |= {
                f"gather_native_{label}": functools.partial(
                    copy, host_at, h_step, None, 0, dev_at, row, g_ptr, 0, n, row, mode
                ),
                f"scatter_native_{label}": functools.partial(
                    copy, dev_at, row, s_ptr, 0, host_at, h_step, None, 0, n, row, mode
                ),
                f"i2i_native_{label}": functools.partial(
                    copy, dev_at, row, s_ptr, 0, host_at, h_step, h_ptr, 0, n, row, mode
                ),
            }
    src_rows, dst_rows = Rows.of(host_ids), Rows.of(scatter_ids)
    staging = buffer(MOVE_BYTES)  # the old default: the whole op in one round
    blocks = (("whole", MOVE_BYTES), ("4m", 4 << 20), ("1m", 1 << 20), ("256k", 1 << 18))
    for label, block in blocks:
        out[f"i2i_numpy_staged_{label}"] = functools.partial(
            copy_rows_numpy, host_all, src_rows, device, dst_rows, staging, block_bytes=block
        )
    all_items = items(host_all)
    out["i2i_numpy_fancy_temp"] = lambda: dev_items.__setitem__(s_np, all_items[h_np])
    return out | {
        "gather_index_select_int64": lambda: torch.index_select(int_dev, 0, g_idx, out=int_host),
        "gather_index_select_float64": lambda: torch.index_select(
            float_dev, 0, g_idx, out=float_host
        ),
        "gather_np_take": lambda: np.take(dev_items, g_np, out=host_items, mode="clip"),
        "gather_np_take_split": lambda: np.take(
            dev_split, g_np, axis=0, out=host_split, mode="clip"
        ),
        "gather_memcpy_per_row": gather_memcpy_per_row,
        "scatter_np_put": lambda: np.put(dev_items, s_np, host_items, mode="clip"),
        "scatter_np_assign": lambda: dev_items.__setitem__(s_np, host_items),
        "scatter_np_assign_split": lambda: dev_split.__setitem__(s_np, host_split),
        "scatter_index_copy": lambda: int_dev.index_copy_(0, s_idx, int_host),
    }


def contiguous(
    kernel: native.NativeKernel, src: torch.Tensor, dst: torch.Tensor, mode: int
) -> Callable[[], None]:
    """The baseline memcpy's bytes through the native kernel: 64 KiB rows in one run."""
    piece = 1 << 16
    rows = src.numel() // piece

    def run() -> None:
        kernel.copy(
            dst.data_ptr(), piece, None, 0, src.data_ptr(), piece, None, 0, rows, piece, mode
        )

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--pages", default="1,16,64,256")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, float] = {}
    base_src, base_dst = buffer(MOVE_BYTES), buffer(MOVE_BYTES)
    kernel = native.load()
    print(f"native kernel: {kernel.name if kernel else native.why_not()}")

    def glibc_memcpy() -> None:
        ctypes.memmove(base_dst.data_ptr(), base_src.data_ptr(), MOVE_BYTES)

    # the baseline: the faster of one glibc memcpy and the same bytes in 64 KiB memcpy pieces
    # (cached stores; glibc streams a 32 MiB copy, measured slower here), timed each round
    baselines: list[Callable[[], object]] = [glibc_memcpy]
    if kernel is not None:
        baselines.append(contiguous(kernel, base_src, base_dst, 2))

    def baseline() -> float:
        best = float("inf")
        for copy in baselines:
            start = time.perf_counter()
            copy()
            best = min(best, time.perf_counter() - start)
        return best

    for layout in ("layer_first", "page_first"):
        print(f"== {layout} host rows (ratio to memcpy of the same bytes)")
        for page in (int(p) for p in args.pages.split(",")):
            row = page * TOKEN_BYTES
            n = MOVE_BYTES // row
            device = buffer(4 * n * row).view(4 * n, row)
            step = row * (STRIDE_ROWS if layout == "page_first" else 1)
            host = buffer(2 * n * step).as_strided((2 * n, row), (step, 1))
            rng = random.Random(page)
            gather_ids = sorted(rng.sample(range(4 * n), n))
            scatter_ids = rng.sample(range(4 * n), n)
            host_ids = sorted(rng.sample(range(2 * n), n))  # short runs, as after churn
            runs = kernels(device, host, gather_ids, scatter_ids, host_ids, kernel)
            runs["contiguous_glibc_memcpy"] = glibc_memcpy  # the baseline's own candidates
            if kernel is not None:
                for mode, label in ((2, "memcpy_64k_pieces"), (1, "stream")):
                    runs[f"contiguous_{label}"] = contiguous(kernel, base_src, base_dst, mode)
            free_rate = spin_rate()
            ratios: dict[str, list[float]] = {name: [] for name in runs}
            for trial in range(args.trials + 1):  # the first round warms up
                for name, run in runs.items():
                    base = baseline()
                    start = time.perf_counter()
                    run()
                    ours = time.perf_counter() - start
                    if trial:
                        ratios[name].append(base / ours)
            print(f"p{page} ({n} rows, split {split_for(n, row)}):")
            for name, values in ratios.items():
                ratio = round(statistics.median(values), 2)
                results[f"{layout}_{name}_p{page}"] = ratio
                if name == "gather_memcpy_per_row" and n > 256:
                    # each row's call takes the GIL back from the spinner, waiting up to the
                    # 5 ms switch interval: thousands of rows would take minutes
                    print(f"    {name:<30} {ratio:.2f}   gil_free (not probed: {n} calls)")
                    continue
                free = round(gil_free(runs[name], free_rate), 2)
                results[f"{layout}_{name}_p{page}_gil_free"] = free
                print(f"    {name:<30} {ratio:.2f}   gil_free {free:.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
