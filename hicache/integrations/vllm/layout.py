"""What the vLLM connector derives from vLLM's configuration, both roles alike: hicache's
layout of the model (from vLLM's own config.json), the page size (vLLM's attention block),
the default tenant (pages hold vLLM's block bytes as its backend packs them), which block
of a state group holds a snapshot, whether loads are asynchronous, and which requests are
cacheable. Pure functions of vLLM's config objects; vLLM is imported
inside the functions that read its objects, so the state-block rules load without it (the
unit tests run where vLLM's CPU build is not installed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hicache.errors import ConfigError
from hicache.integrations.vllm.plan import NULL_BLOCK
from hicache.model import LayerMap, layout_from_hf_config, load_layout, shard_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def layer_map_of(vllm_config: VllmConfig) -> LayerMap:
    """hicache's layout of the model vLLM serves, read from its own config.json, as one
    tensor-parallel rank holds it (vLLM's tensor_parallel_size: each rank's KV heads and
    state); the sidecar compares it with its model at hello, so a connector never shares
    pages across models or tensor-parallel sizes."""
    model = vllm_config.model_config
    path = Path(str(model.model)) / "config.json"
    if path.is_file():
        layout = load_layout(path)
    else:
        layout = layout_from_hf_config(model.hf_config.to_dict(), str(model.model))
    return LayerMap(shard_layout(layout, int(vllm_config.parallel_config.tensor_parallel_size)))


def token_block_size(kv_cache_config: KVCacheConfig) -> int:
    from vllm.v1.kv_cache_interface import MambaSpec

    sizes = {
        g.kv_cache_spec.block_size
        for g in kv_cache_config.kv_cache_groups
        if not isinstance(g.kv_cache_spec, MambaSpec)
    }
    if len(sizes) != 1:
        raise ConfigError(
            f"vLLM's attention KV-cache groups use block sizes {sorted(sizes)}; hicache needs "
            "one page size for every token group"
        )
    return sizes.pop()


def default_tenant(kv_cache_config: KVCacheConfig) -> str:
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import MambaSpec

    platform = str(current_platform.device_type or "unknown")
    if not current_platform.is_cpu():
        return f"vllm-{platform}"
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isas = set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            continue
        isas.add(
            _get_attn_isa(
                getattr(spec, "dtype", torch.bfloat16),
                spec.block_size,
                getattr(spec, "head_size", None),
            )
        )
    return "vllm-cpu-" + "-".join(sorted(isas))


def state_load_block(block_ids: Sequence[int], pages: int) -> int:
    """The block a state group's snapshot after `pages` pages is loaded into."""
    return _state_block(block_ids, pages)


def state_store_block(block_ids: Sequence[int], pages: int) -> int | None:
    """The block holding a state group's state after exactly `pages` pages (the step ended
    on that boundary)."""
    block = _state_block(block_ids, pages)
    return None if block == NULL_BLOCK else block


def _state_block(block_ids: Sequence[int], pages: int) -> int:
    if not block_ids:
        return NULL_BLOCK
    return block_ids[min(pages, len(block_ids)) - 1]


def async_loads_of(mode: str, kv_cache_config: KVCacheConfig) -> bool:
    """Layer-wise loads (the forward waits per layer: the overlap) report failures as
    block ids, which vLLM maps back to requests only with one KV-cache group; with more
    (sliding + full, hybrids) a load must be asynchronous and fail by request."""
    groups = len(kv_cache_config.kv_cache_groups)
    if mode in ("layerwise", "whole") and groups > 1:
        raise ConfigError(
            f"kv_connector_extra_config.load_mode: {mode!r} needs one KV-cache group; "
            f"this model has {groups} (vLLM reports a failed load of a multi-group model "
            "only per request, so its loads are 'async')"
        )
    return mode == "async" or (mode == "auto" and groups > 1)


def cacheable(request: Request) -> bool:
    """Pages are keyed by token ids alone: requests whose KV depends on more (LoRA,
    multimodal inputs, a cache salt) are neither looked up nor stored."""
    return not (
        getattr(request, "lora_request", None)
        or getattr(request, "mm_features", None)
        or getattr(request, "cache_salt", None)
        # prompt embeddings: vLLM's token ids are placeholders (zeros) then
        or getattr(request, "prompt_embeds", None) is not None
    )
