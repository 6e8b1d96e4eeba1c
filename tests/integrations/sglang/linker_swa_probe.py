"""`HicacheLinker` with an SWA component, driven directly as `UnifiedCacheLinkerWrapper` drives
it, on SGLang's real `SWAKVPool` (CPU; a tiny gpt-oss: sliding layers 0 and 2, full layers 1
and 3, a 64-token window = 4 pages) against a real `hicache serve` of that model (runs in the
SGLang environment; `test_linker_direct.py` starts it and judges its one JSON line).

    python -m tests.integrations.sglang.linker_swa_probe DEPLOY.yaml MODEL_DIR

What SGLang sends (`components/swa.py`, `build_external_linker_transfer`): a KV transfer of
the call's pages and an SWA transfer of its trailing window (at most 4 keys, slots of the SWA
pool). Checks, in order: offload of 6 pages with their window -> lookups (the whole prefix; a
longer one; a window SGLang asks one page earlier, whose first page the sidecar never got; a
pool the linker does not move) -> load of both pools into other slots, layer by layer through
the counter -> bytes equal in both pools; a load of the SWA window alone (SGLang holds the
full pages) -> bytes equal; a load whose window misses a page -> refused, nothing queued;
a queued load of both pools cancelled -> nothing queued.
"""

from __future__ import annotations

import json
import sys
import types
from typing import Any

import torch

from tests.integrations.sglang.linker_probe import PAGE, completions, hashes, slots

SWA_LAYERS, FULL_LAYERS = [0, 2], [1, 3]


def main(deploy: str, model: str) -> dict[str, Any]:
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from hicache.integrations.sglang.linker import HicacheLinker

    kv = SWAKVPool(
        size=PAGE * 64,
        size_swa=PAGE * 32,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=64,
        swa_attention_layer_ids=SWA_LAYERS,
        full_attention_layer_ids=FULL_LAYERS,
        device="cpu",
    )
    params = types.SimpleNamespace(
        page_size=PAGE, token_to_kv_pool_allocator=types.SimpleNamespace(get_kvcache=lambda: kv)
    )
    linker = HicacheLinker(
        types.SimpleNamespace(model_path=model, tp_size=1),
        params,
        components={ComponentType.FULL, ComponentType.SWA},
        extra_config={"config": deploy, "load_timeout_s": 10, "retry_after_s": 0.2},
    )
    out: dict[str, Any] = {"pools": sorted(str(p.value) for p in linker.pools)}
    full, swa = kv.full_kv_pool, kv.swa_kv_pool
    gen = torch.Generator().manual_seed(5)
    full_pages, swa_pages = [3, 4, 5, 6, 7, 8], [4, 5, 6, 7]  # the window: the last 4 pages
    for pool, pages in ((full, full_pages), (swa, swa_pages)):
        for layer in range(2):
            for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
                buf[slots(pages)] = torch.randn(buf[slots(pages)].shape, generator=gen).to(
                    buf.dtype
                )
    keys = hashes("swa-probe", 7)
    trailing = PoolHitPolicy.TRAILING_PAGES

    def kv_t(page_hashes: list[str], pages: list[int] | None) -> Any:
        return PoolTransfer(
            name=PoolName.KV,
            keys=page_hashes,
            device_indices=None if pages is None else slots(pages),
        )

    def swa_t(page_hashes: list[str], pages: list[int] | None) -> Any:
        return PoolTransfer(
            name=PoolName.SWA,
            keys=page_hashes,
            device_indices=None if pages is None else slots(pages),
            hit_policy=trailing,
        )

    out["offload_queued"] = linker.offload(
        [kv_t(keys[:6], full_pages), swa_t(keys[2:6], swa_pages)]
    )
    out["offloads_completed"] = completions(linker, 1)
    out["lookup_whole"] = linker.lookup("r1", [kv_t(keys[:6], None), swa_t(keys[2:6], None)])
    out["lookup_longer"] = linker.lookup("r2", [kv_t(keys, None), swa_t(keys[3:], None)])
    out["lookup_window_short"] = linker.lookup("r3", [kv_t(keys[:5], None), swa_t(keys[1:5], None)])
    mamba = PoolTransfer(name=PoolName.MAMBA, keys=keys[5:6], hit_policy=trailing)
    out["lookup_unmoved_pool"] = linker.lookup("r4", [kv_t(keys[:6], None), mamba])

    def loaded(pool: Any, target: list[int], source: list[int]) -> bool:
        return all(
            torch.equal(buf[slots(target)], buf[slots(source)])
            for layer in range(2)
            for buf in (pool.k_buffer[layer], pool.v_buffer[layer])
        )

    def stream() -> bool:
        index = linker.start_layer_wise_loading()
        linker.layer_done_counter.set_consumer(index)
        for layer in range(4):
            linker.layer_done_counter.wait_until(layer)
        return bool(linker.finish_layer_wise_loading(index))

    full_target, swa_target = [20, 21, 22, 23, 24, 25], [10, 11, 12, 13]
    out["load_queued"] = linker.load(
        "r5", [kv_t(keys[:6], full_target), swa_t(keys[2:6], swa_target)]
    )
    out["load_landed"] = stream()
    out["full_bytes_equal"] = loaded(full, full_target, full_pages)
    out["swa_bytes_equal"] = loaded(swa, swa_target, swa_pages)

    window_only = [14, 15, 16, 17]
    out["window_only_queued"] = linker.load("r6", [swa_t(keys[2:6], window_only)])
    out["window_only_landed"] = stream()
    out["window_only_bytes_equal"] = loaded(swa, window_only, swa_pages)

    out["short_window_queued"] = linker.load(
        "r7", [kv_t(keys[:5], [30, 31, 32, 33, 34]), swa_t(keys[1:5], [20, 21, 22, 23])]
    )
    out["no_batch_after_refusal"] = linker.start_layer_wise_loading()
    # a queued load of both pools cancelled: each of its sidecar loads waited out, none left
    out["cancel_queued"] = linker.load(
        "r8", [kv_t(keys[:6], [40, 41, 42, 43, 44, 45]), swa_t(keys[2:6], [24, 25, 26, 27])]
    )
    out["cancelled"] = linker.cancel_queued_load("r8")
    out["no_batch_after_cancel"] = linker.start_layer_wise_loading()
    linker.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
