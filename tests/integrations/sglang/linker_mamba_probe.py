"""`HicacheLinker` with a MAMBA component, driven directly as `UnifiedCacheLinkerWrapper` drives
it, on SGLang's real `MambaPool` and `HybridLinearKVPool` (CPU; a tiny Qwen3-Next: linear
layers 0 and 2, full layers 1 and 3) against a real `hicache serve` of that model (runs in the
SGLang environment; `test_linker_direct.py` starts it and judges its one JSON line).

    python -m tests.integrations.sglang.linker_mamba_probe DEPLOY.yaml MODEL_DIR

What SGLang sends (`components/mamba.py`, `build_external_linker_transfer`): beside the KV
transfer, a MAMBA transfer of one key (the last page's: the state after it) and one slot of
`req_to_token_pool`'s Mamba pool. Checks, in order: the linker's counter registered with
`req_to_token_pool`; two offloads (states after 6 and after 4 pages) -> lookups (lengths where
a state is stored; a state missing) -> load of KV and state into other slots, layer by layer
through the counter -> bytes equal; the state alone -> bytes equal; a load whose state was
never stored -> refused, nothing queued.
"""

from __future__ import annotations

import json
import sys
import types
from typing import Any

import torch

from tests.integrations.sglang.linker_probe import PAGE, completions, hashes, slots

FULL_LAYERS, MAMBA_LAYERS = [1, 3], [0, 2]
CONV, TEMPORAL = (256, 3), (4, 32, 32)  # the tiny Qwen3-Next's (hybrid_driver's)


def main(deploy: str, model: str) -> dict[str, Any]:
    from sglang.srt.configs.mamba_utils import (
        Mamba2CacheParams,
        Mamba2StateDType,
        Mamba2StateShape,
    )
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from hicache.integrations.sglang.linker import HicacheLinker

    shape = Mamba2StateShape(
        conv=[CONV],
        temporal=TEMPORAL,
        intermediate_size=128,
        conv_dim=CONV[0],
        ssm_state_size=32,
        num_heads=4,
        head_dim=32,
        state_size=32,
        conv_kernel=4,
    )
    dtypes = Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32)
    mamba = MambaPool(
        size=8,
        spec_state_size=0,
        cache_params=Mamba2CacheParams(shape=shape, layers=MAMBA_LAYERS, dtype=dtypes),
        mamba_layer_ids=MAMBA_LAYERS,
        device="cpu",
    )
    kv = HybridLinearKVPool(
        size=PAGE * 64,
        dtype=torch.bfloat16,
        page_size=PAGE,
        head_num=2,
        head_dim=64,
        full_attention_layer_ids=FULL_LAYERS,
        device="cpu",
        mamba_pool=mamba,
    )
    registered: list[Any] = []
    params = types.SimpleNamespace(
        page_size=PAGE,
        token_to_kv_pool_allocator=types.SimpleNamespace(get_kvcache=lambda: kv),
        req_to_token_pool=types.SimpleNamespace(
            mamba_pool=mamba, register_layer_transfer_counter=registered.append
        ),
    )
    linker = HicacheLinker(
        types.SimpleNamespace(model_path=model, tp_size=1),
        params,
        components={ComponentType.FULL, ComponentType.MAMBA},
        extra_config={"config": deploy, "load_timeout_s": 10, "retry_after_s": 0.2},
    )
    out: dict[str, Any] = {
        "pools": sorted(str(p.value) for p in linker.pools),
        "counter_registered": registered == [linker.layer_done_counter],
    }
    full = kv.full_kv_pool
    gen = torch.Generator().manual_seed(9)
    pages = [3, 4, 5, 6, 7, 8]
    for layer in range(2):
        for buf in (full.k_buffer[layer], full.v_buffer[layer]):
            buf[slots(pages)] = torch.randn(buf[slots(pages)].shape, generator=gen).to(buf.dtype)

    def state() -> list[torch.Tensor]:  # the pool's tensors now (the linker may reback them)
        return [mamba.mamba_cache.conv[0], mamba.mamba_cache.temporal]

    for slot in (2, 3):
        for t in state():
            t[:, slot] = torch.randn(t[:, slot].shape, generator=gen).to(t.dtype)
    keys = hashes("mamba-probe", 7)
    trailing = PoolHitPolicy.TRAILING_PAGES

    def kv_t(page_hashes: list[str], target: list[int] | None) -> Any:
        indices = None if target is None else slots(target)
        return PoolTransfer(name=PoolName.KV, keys=page_hashes, device_indices=indices)

    def state_t(page_hash: str, slot: int | None) -> Any:
        indices = None if slot is None else torch.tensor([slot], dtype=torch.int64)
        return PoolTransfer(
            name=PoolName.MAMBA, keys=[page_hash], device_indices=indices, hit_policy=trailing
        )

    out["offloads_queued"] = [
        linker.offload([kv_t(keys[:6], pages), state_t(keys[5], 2)]),
        linker.offload([kv_t(keys[:4], pages[:4]), state_t(keys[3], 3)]),
    ]
    out["offloads_completed"] = completions(linker, 2)
    out["lookup_whole"] = linker.lookup("r1", [kv_t(keys[:6], None), state_t(keys[5], None)])
    out["lookup_longer"] = linker.lookup("r2", [kv_t(keys, None), state_t(keys[6], None)])
    out["lookup_no_state_at_end"] = linker.lookup(
        "r3", [kv_t(keys[:5], None), state_t(keys[4], None)]
    )

    def stream() -> bool:
        index = linker.start_layer_wise_loading()
        linker.layer_done_counter.set_consumer(index)
        for layer in range(4):
            linker.layer_done_counter.wait_until(layer)
        return bool(linker.finish_layer_wise_loading(index))

    def same_state(target: int, source: int) -> bool:
        return all(torch.equal(t[:, target], t[:, source]) for t in state())

    target = [20, 21, 22, 23, 24, 25]
    out["load_queued"] = linker.load("r4", [kv_t(keys[:6], target), state_t(keys[5], 5)])
    out["load_landed"] = stream()
    out["kv_bytes_equal"] = all(
        torch.equal(buf[slots(target)], buf[slots(pages)])
        for layer in range(2)
        for buf in (full.k_buffer[layer], full.v_buffer[layer])
    )
    out["state_bytes_equal"] = same_state(5, 2)
    out["state_only_queued"] = linker.load("r5", [state_t(keys[3], 6)])
    out["state_only_landed"] = stream()
    out["state_only_bytes_equal"] = same_state(6, 3)
    out["missing_state_queued"] = linker.load(
        "r6", [kv_t(keys[:5], [30, 31, 32, 33, 34]), state_t(keys[4], 7)]
    )
    out["no_batch_after_refusal"] = linker.start_layer_wise_loading()
    linker.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
