"""What sealing the engines' pools costs: copies into a sealed memfd against copies into a
/dev/shm file of the same size (what pools were before; the baseline), and the time the sidecar
takes to open, check and map an engine's memfd at `register_pools`.

Both targets are shmem pages mapped MAP_SHARED; the seals are checked once, at registration,
never per copy, so the copy ratio should be ~1 (a ratio well off 1 would mean the mapping
differs, not the seals). Each trial copies a 256 MiB host tensor into each target once, in
alternating order, on the calling thread; the figure is the median of the per-trial ratios.

    python benchmarks/shared_memory.py [--trials 9] [--mib 256]

The last line is one JSON object: {"memfd_copy_vs_shm_file": ratio, "register_map_us": µs}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from hicache.channel.shm import map_fd, map_peer_fd, sealed_memfd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    nbytes = args.mib * 2**20
    fd = sealed_memfd("bench-pool", nbytes)
    sealed = map_fd(fd, nbytes)
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="bench-pool-") as file:
        os.ftruncate(file.fileno(), nbytes)
        plain = torch.from_file(file.name, shared=True, size=nbytes, dtype=torch.uint8)
        source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        sealed.copy_(source)  # fault every page in before timing
        plain.copy_(source)
        ratios = []
        for trial in range(args.trials):
            seconds = {}
            order = [("memfd", sealed), ("file", plain)]
            for name, target in order if trial % 2 else order[::-1]:
                started = time.perf_counter()
                target.copy_(source)
                seconds[name] = time.perf_counter() - started
            ratios.append(seconds["file"] / seconds["memfd"])
    registrations = []
    for _ in range(max(50, args.trials * 10)):
        started = time.perf_counter()
        memory = map_peer_fd(os.getpid(), fd, nbytes, "fd")
        registrations.append(time.perf_counter() - started)
        del memory
    os.close(fd)
    figures = {
        "memfd_copy_vs_shm_file": round(statistics.median(ratios), 3),
        "register_map_us": round(statistics.median(registrations) * 1e6, 1),
        "mib": args.mib,
    }
    print(f"copy into a sealed memfd / into a /dev/shm file: {figures['memfd_copy_vs_shm_file']}")
    print(f"open + check + map an engine's memfd: {figures['register_map_us']} µs")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
