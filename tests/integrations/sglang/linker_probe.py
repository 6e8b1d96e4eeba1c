"""`HicacheLinker` driven directly, the way `UnifiedCacheLinkerWrapper` drives it, on SGLang's
real `MHATokenToKVPool` (CPU) against a real `hicache serve` (runs in the SGLang environment;
`test_linker_direct.py` starts it and judges its one JSON line).

    python -m tests.integrations.sglang.linker_probe DEPLOY.yaml MODEL_DIR

Checks, in order: offload (pages written by "the forward") -> completions popped -> lookup of
a tail starting mid-prompt -> load into other slots, layer by layer through the counter ->
bytes equal; a load whose hit is shorter than asked (a page never stored) refused once what
did hit has landed; a queued load cancelled; reset; the sidecar gone (SIGTERM by the test when
the probe says `stop-sidecar`) -> lookups answer [], loads and offloads refused, no raise.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import types
from typing import Any

import torch

PAGE = 16


def hashes(seed: str, n: int) -> list[str]:
    out, previous = [], seed.encode()
    for i in range(n):
        previous = hashlib.sha256(previous + bytes([i])).digest()
        out.append(previous.hex())
    return out


def slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).to(torch.int64)


def completions(linker: Any, count: int, timeout_s: float = 60.0) -> list[bool]:
    """What SGLang's scheduler does each step: pop the offloads that completed."""
    deadline = time.monotonic() + timeout_s
    while linker.num_completed_offloads() < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} offloads did not complete in {timeout_s} s")
        time.sleep(0.01)
    return [linker.pop_completed_offload() for _ in range(count)]


def main(deploy: str, model: str) -> dict[str, Any]:
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from hicache.integrations.sglang.linker import HicacheLinker

    kv = MHATokenToKVPool(
        size=PAGE * 64,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=32,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=2,
    )
    params = types.SimpleNamespace(
        page_size=PAGE, token_to_kv_pool_allocator=types.SimpleNamespace(get_kvcache=lambda: kv)
    )
    server_args = types.SimpleNamespace(model_path=model, tp_size=1)
    linker = HicacheLinker(
        server_args,
        params,
        components={ComponentType.FULL},
        extra_config={"config": deploy, "load_timeout_s": 10, "retry_after_s": 0.2},
    )
    out: dict[str, Any] = {"rebacked_or_shared": type(kv.k_buffer[0]).__name__}
    gen = torch.Generator().manual_seed(3)
    written = [3, 4, 5, 6]
    for layer in range(2):
        for buf in (kv.k_buffer[layer], kv.v_buffer[layer]):
            rows = slots(written)
            buf[rows] = torch.randn(buf[rows].shape, generator=gen).to(buf.dtype)
    keys = hashes("probe", 4)

    def transfer(page_hashes: list[str], pages: list[int] | None) -> Any:
        return PoolTransfer(
            name=PoolName.KV,
            keys=page_hashes,
            device_indices=None if pages is None else slots(pages),
        )

    out["offload_queued"] = linker.offload([transfer(keys, written)])
    out["offloads_completed"] = completions(linker, 1)
    out["lookup_whole"] = linker.lookup("r1", [transfer(keys, None)])
    out["lookup_tail"] = linker.lookup("r2", [transfer(keys[1:], None)])
    out["lookup_cold"] = linker.lookup("r3", [transfer(hashes("cold", 2), None)])

    target = [20, 21, 22]
    out["load_queued"] = linker.load("r2", [transfer(keys[1:], target)])
    index = linker.start_layer_wise_loading()
    linker.layer_done_counter.set_consumer(index)
    for layer in range(2):
        linker.layer_done_counter.wait_until(layer)
    out["load_landed"] = linker.finish_layer_wise_loading(index)
    out["bytes_equal"] = all(
        torch.equal(buf[slots(target)], buf[slots(written[1:])])
        for layer in range(2)
        for buf in (kv.k_buffer[layer], kv.v_buffer[layer])
    )

    # the hit is shorter than asked (a page never stored in the middle): the part that hit
    # is copied and waited out, the load refused (SGLang frees the slots and recomputes)
    broken = [keys[0], hashes("hole", 1)[0], keys[2]]
    out["partial_load_queued"] = linker.load("r4", [transfer(broken, [30, 31, 32])])
    out["no_batch_after_refusal"] = linker.start_layer_wise_loading()

    out["cancel_queued"] = linker.load("r5", [transfer(keys[:2], [40, 41])])
    out["cancelled"] = linker.cancel_queued_load("r5")
    out["no_batch_after_cancel"] = linker.start_layer_wise_loading()
    linker.reset()

    print("stop-sidecar", flush=True)
    sys.stdin.readline()  # the test stopped it
    out["down_lookup"] = linker.lookup("r6", [transfer(keys, None)])
    out["down_load"] = linker.load("r7", [transfer(keys, [50, 51, 52, 53])])
    out["down_offload"] = linker.offload([transfer(hashes("late", 1), [7])])
    out["down_offload_completed"] = completions(linker, 1)
    linker.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
