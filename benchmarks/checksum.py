"""What the L3 object checksum costs, against a memcpy of the same bytes, measured in one run.

Every L3 object carries an xxh3-64 of its payload (hicache/storage/object_format.py), computed
on every put and verified on every get. This times, on one thread, for 1 MiB pages (the size
benchmarks/storage.py moves): xxh3-64 over the page, zlib's CRC-32 (the checksum it replaced)
and a memcpy of the same bytes into a preallocated buffer (the baseline: the least any tier
does with a page). Each trial times the three back to back; a figure is the median over the
trials. `xxh3_vs_memcpy` = memcpy time / xxh3 time (above 1: the checksum is cheaper than
touching the bytes twice, which holds when it reads at a higher rate than memcpy moves).

    python benchmarks/checksum.py        # last line: one JSON object
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
import zlib
from collections.abc import Callable

import xxhash


def _time(fn: Callable[[], None], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-mib", type=int, default=1)
    parser.add_argument("--pages", type=int, default=64, help="distinct pages (beyond the caches)")
    parser.add_argument("--trials", type=int, default=11)
    args = parser.parse_args()
    size = args.page_mib * 2**20
    pages = [bytearray(size) for _ in range(args.pages)]
    for i, page in enumerate(pages):
        page[:] = bytes([i % 251]) * size
    views = [memoryview(p) for p in pages]
    target = bytearray(size)
    target_ptr = ctypes.addressof(ctypes.c_char.from_buffer(target))
    ptrs = [ctypes.addressof(ctypes.c_char.from_buffer(p)) for p in pages]

    def xxh3() -> None:
        for view in views:
            xxhash.xxh3_64_intdigest(view)

    def crc32() -> None:
        for view in views:
            zlib.crc32(view)

    def memcpy() -> None:
        for ptr in ptrs:
            ctypes.memmove(target_ptr, ptr, size)

    runs: dict[str, list[float]] = {"xxh3": [], "crc32": [], "memcpy": []}
    for trial in range(args.trials + 1):  # the first round warms up and is dropped
        for name, fn in (("memcpy", memcpy), ("xxh3", xxh3), ("crc32", crc32)):
            seconds = _time(fn, 1)
            if trial:
                runs[name].append(seconds)
    total = size * args.pages
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratio = statistics.median(m / x for m, x in zip(runs["memcpy"], runs["xxh3"], strict=True))
    result = {
        "xxh3_gbps": round(total / med["xxh3"] / 1e9, 2),
        "crc32_gbps": round(total / med["crc32"] / 1e9, 2),
        "memcpy_gbps": round(total / med["memcpy"] / 1e9, 2),
        "xxh3_vs_memcpy": round(ratio, 2),
    }
    print(
        f"xxh3-64 {result['xxh3_gbps']} GB/s, CRC-32 {result['crc32_gbps']} GB/s, "
        f"memcpy {result['memcpy_gbps']} GB/s (1 MiB pages, one thread)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
