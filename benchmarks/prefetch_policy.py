"""The `timeout` prefetch policy's deadline under load: the old fixed one vs the new auto
default vs `wait_complete`, measured in one run over the same L3.

Several engines (asyncio tasks over one `TieredCache`, as the sidecar serves them) each
load a series of prompts that only L3 holds — persisted by an earlier process, so every
load asks L3 (discovery), fetches per the policy, and then copies L2 -> L1 — with a short
simulated forward between requests. L3 is a file backend behind a bandwidth limit (one
link: the guarded store reads one batch at a time, so concurrent engines queue behind each
other, as they do on a real L3). Hit rate = tokens loaded / tokens L3 could have served.
Each policy runs on a fresh cache (empty index, empty L2) over the same L3 files:

- `fixed`: `prefetch_timeout_s: 0.002` (2 ms + 2 us per token: the old, unconfigurable one);
- `auto`: the default (`prefetch_timeout_s: auto`: L3's measured read rate, x headroom, plus
  a floor, at most the cap);
- `wait_complete`: the baseline — waits for every fetch, serves every hit.

    .venv/bin/python benchmarks/prefetch_policy.py [--engines 8] [--prompts 5]

Last line: one JSON object with each hit rate, and `auto_vs_wait_complete` (their ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache.assembly import by_key
from hicache.cache import TieredCache
from hicache.model import ExplicitLayout, LayerMap
from hicache.scheduler import run
from hicache.storage import FileBackend, GuardedStore
from hicache.testing.faulty_storage import FaultyBackend

PAGE = 16
LAYOUT = ExplicitLayout.model_validate(
    {
        "model_type": "bench",
        "layers": [{"kind": "full", "kv_heads": 8, "head_dim": 128} for _ in range(4)],
    }
).to_layout("benchmarks/prefetch_policy.py")  # 256 KiB per 16-token page in float16


Deadline = float | Literal["auto"]


def cache_over(engines: int, pages: int, policy: str, deadline: Deadline = "auto") -> TieredCache:
    """A fresh cache (empty index, empty L2) for `engines` engines of `pages`-page prompts."""
    embedded = by_key.embedded(
        LayerMap(LAYOUT),
        dtype=torch.float16,
        page_size_tokens=PAGE,
        host_capacity_bytes=1 << 20,  # unused: sized in pages below
        device_pages=engines * pages,
        host_pages_per_group={"full": 2 * engines * pages},  # room for every engine's fetch
    )
    return by_key.tiered(embedded, store=None, prefetch_policy=policy, prefetch_timeout_s=deadline)


def prompt(engine: int, n: int, tokens: int) -> list[int]:
    first = 1_000_000 * (engine + 1) + 10_000 * n
    return list(range(first, first + tokens))


async def persist(root: Path, engines: int, prompts: int, tokens: int) -> None:
    """An earlier process stored every prompt; L3 holds them all."""
    pages = tokens // PAGE
    cache = cache_over(engines, pages, "best_effort")
    cache.attach_l3(GuardedStore(FileBackend(root, capacity_bytes=8 << 30), base_timeout_s=30))
    try:
        for pool in cache.embedded.device_pools.values():
            for layer in pool.tensors:
                for t in layer.values():
                    raw = t.view(-1).view(torch.uint8)
                    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        async with cache.running():
            for e in range(engines):
                for n in range(prompts):
                    dev = list(range(e * pages, (e + 1) * pages))
                    await cache.store(prompt(e, n, tokens), {"full": dev})
                await cache.drain()
                cache.clear_l2()
    finally:
        cache.embedded.close()


async def serve(
    root: Path,
    engines: int,
    prompts: int,
    tokens: int,
    bandwidth: float,
    forward_s: float,
    policy: str,
    deadline: Deadline = "auto",
) -> dict[str, float]:
    pages = tokens // PAGE
    cache = cache_over(engines, pages, policy, deadline)
    faulty = FaultyBackend(
        FileBackend(root, capacity_bytes=8 << 30),
        vectored=True,
        bandwidth_bytes_per_s=bandwidth,
        latency_s=0.001,
    )
    cache.attach_l3(GuardedStore(faulty, base_timeout_s=30))
    loaded = asked = 0
    try:
        async with cache.running():

            async def engine(e: int) -> None:
                nonlocal loaded, asked
                dev = list(range(e * pages, (e + 1) * pages))
                for n in range(prompts):
                    handle, hit = await cache.load(prompt(e, n, tokens), {"full": dev})
                    asked += tokens
                    if handle is not None and (await handle.done()).ok:
                        loaded += hit.tokens_total
                    await asyncio.sleep(forward_s)  # the engine computes what did not hit

            started = time.perf_counter()
            await asyncio.gather(*(engine(e) for e in range(engines)))
            seconds = time.perf_counter() - started
            await cache.drain()
    finally:
        cache.embedded.close()
    rate = cache.io.read_rate.bytes_per_s()
    return {
        "hit_rate": loaded / asked,
        "seconds": seconds,
        "read_mb_per_s": (rate or 0.0) / 1e6,
    }


async def main(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="hicache-prefetch-") as tmp:
        root = Path(tmp) / "l3"
        await persist(root, args.engines, args.prompts, args.tokens)
        common = (root, args.engines, args.prompts, args.tokens, args.bandwidth, args.forward_s)
        fixed = await serve(*common, "timeout", 0.002)
        auto = await serve(*common, "timeout")
        complete = await serve(*common, "wait_complete")
    for name, figures in (("fixed", fixed), ("auto", auto), ("wait_complete", complete)):
        print(
            f"{name:>13}: hit rate {figures['hit_rate']:6.1%}  {figures['seconds']:5.2f} s  "
            f"(L3 read rate measured: {figures['read_mb_per_s']:.0f} MB/s)"
        )
    return {
        "engines": args.engines,
        "prompt_tokens": args.tokens,
        "l3_bandwidth_mb_per_s": args.bandwidth / 1e6,
        "hit_rate_fixed": round(fixed["hit_rate"], 4),
        "hit_rate_auto": round(auto["hit_rate"], 4),
        "hit_rate_wait_complete": round(complete["hit_rate"], 4),
        "auto_vs_wait_complete": round(auto["hit_rate"] / complete["hit_rate"], 4),
        "seconds_fixed": round(fixed["seconds"], 2),
        "seconds_auto": round(auto["seconds"], 2),
        "seconds_wait_complete": round(complete["seconds"], 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=int, default=8, help="concurrent engines")
    parser.add_argument("--prompts", type=int, default=5, help="prompts each engine loads")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per prompt")
    parser.add_argument(
        "--bandwidth", type=float, default=500e6, help="L3 read bandwidth, bytes per second"
    )
    parser.add_argument("--forward-s", type=float, default=0.005, help="compute per request")
    print(json.dumps(run(main(parser.parse_args()))))
