"""`shard_layout`: one tensor-parallel rank's share of a model's caches, on real configs
(`configs/models/`), against the split vLLM's QKVParallelLinear / MambaStateShapeCalculator
make; replicated groups; page keys of replicated and per-rank groups; the refusals."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hicache.assembly import by_key
from hicache.cache.keyers import page_keyers
from hicache.errors import ConfigError
from hicache.memory import CacheDtypes, GroupGeometry
from hicache.model import (
    CacheKind,
    LayerMap,
    ModelLayout,
    layout_from_hf_config,
    load_layout,
    shard_layout,
)
from hicache.model.explicit import ExplicitLayout
from tests.conftest import shared_model


def sharded(name: str, tp_size: int) -> ModelLayout:
    return shard_layout(load_layout(shared_model(name)), tp_size)


def heads(layout: ModelLayout, group: str = "full") -> int | None:
    return layout.group(group).spec.num_kv_heads


def states(layout: ModelLayout, group: str) -> dict[str, tuple[int, ...]]:
    return dict(layout.group(group).spec.state_shapes)


@pytest.mark.parametrize(("tp_size", "per_rank"), [(1, 8), (2, 4), (4, 2), (8, 1), (16, 1)])
def test_gqa_heads_split_then_replicate(tp_size: int, per_rank: int) -> None:
    layout = sharded("llama-3.1-8b.json", tp_size)
    assert (layout.tp_size, heads(layout)) == (tp_size, per_rank)
    assert not layout.group("full").replicated  # per rank even when heads are replicated
    spec = layout.group("full").spec
    assert (spec.head_dim, spec.v_head_dim) == (128, 128)


def test_tp_size_1_is_the_global_layout() -> None:
    layout = load_layout(shared_model("llama-3.1-8b.json"))
    assert shard_layout(layout, 1) is layout


def test_two_kv_heads_at_tp_4_are_replicated_one_per_rank() -> None:
    layout = sharded("qwen3_next_80b.json", 4)  # 2 KV heads: ranks 0,1 hold head 0
    assert heads(layout) == 1
    assert "one rank of tp_size 4" in layout.rule


def test_kv_heads_not_divisible_are_refused() -> None:
    with pytest.raises(ConfigError) as err:
        sharded("qwen2_7b.json", 6)  # 4 KV heads
    assert str(err.value) == (
        "model.tp_size 6 is above the 4 KV heads of qwen2's layer 0 (full-attention layer) "
        "and not a multiple of them, so ranks cannot replicate heads evenly; allowed: a "
        "divisor of 4 or a multiple of it"
    )
    with pytest.raises(ConfigError) as err:
        sharded("llama-3.1-8b.json", 3)
    assert str(err.value) == (
        "model.tp_size 3 does not divide the 8 KV heads of llama's layer 0 (full-attention "
        "layer); allowed: a tp_size that divides 8, or a multiple of it"
    )


def test_mla_latent_is_unchanged_and_replicated() -> None:
    config = json.loads(shared_model("deepseek_v32_exp.json").read_text())
    v3 = layout_from_hf_config({**config, "model_type": "deepseek_v3"})
    for tp_size in (2, 8, 16):
        layout = shard_layout(v3, tp_size)
        group = layout.group("full")
        assert group.spec == v3.group("full").spec  # 576-wide latent on every rank
        assert group.replicated
        assert group.spec.head_dim == 576


def test_dsa_latent_and_indexer_are_unchanged_and_replicated() -> None:
    layout = sharded("deepseek_v32_exp.json", 8)
    group = layout.group("sparse")
    assert group.replicated
    assert group.spec.token_tensors() == (("kv", (1, 576)), ("index_k", (1, 128)))
    glm5 = {
        "model_type": "glm_moe_dsa",
        "num_hidden_layers": 4,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "index_head_dim": 128,
    }
    glm_layout = shard_layout(layout_from_hf_config(glm5), 8)
    assert glm_layout.group("sparse").replicated
    assert glm_layout.group("sparse").spec == layout_from_hf_config(glm5).group("sparse").spec


def test_mamba2_hybrid_splits_heads_and_groups() -> None:
    # nemotron-h 8B: 128 heads x 64, 8 groups of state 128, conv kernel 4
    assert states(sharded("nemotron_h_8b.json", 1), "mamba") == {
        "conv": (8192 + 2 * 8 * 128, 3),
        "ssm": (128, 64, 128),
    }
    rank = sharded("nemotron_h_8b.json", 8)
    assert states(rank, "mamba") == {"conv": (1280, 3), "ssm": (16, 64, 128)}
    assert heads(rank) == 1
    assert not rank.group("mamba").replicated
    with pytest.raises(ConfigError, match=r"tp_size 16 does not divide the 8 Mamba-2 groups"):
        sharded("nemotron_h_8b.json", 16)


def test_mamba2_single_group_is_replicated_per_rank() -> None:
    # falcon-h1 7B: d_ssm 3072, 1 group of state 256, 24 heads: vLLM's extra groups give
    # each of 4 ranks its own copy of the group: (3072 + 2 * 4 * 256) / 4 conv channels
    assert states(sharded("falcon_h1_7b.json", 1), "mamba")["conv"] == (3072 + 2 * 256, 3)
    rank = sharded("falcon_h1_7b.json", 4)
    assert states(rank, "mamba") == {"conv": (1280, 3), "ssm": (6, 128, 256)}
    assert heads(rank) == 1  # 2 KV heads, replicated


def test_mamba1_hybrid_splits_channels() -> None:
    rank = sharded("jamba_v01.json", 2)
    assert states(rank, "mamba") == {"conv": (4096, 3), "ssm": (4096, 16)}
    assert heads(rank) == 4


def test_gated_delta_net_splits_key_and_value_heads() -> None:
    # qwen3-next 80B: 16 key heads, 32 value heads, 128 wide each
    rank = sharded("qwen3_next_80b.json", 4)
    conv = 2 * (16 // 4) * 128 + (32 // 4) * 128
    assert states(rank, "linear") == {"conv": (conv, 3), "recurrent": (8, 128, 128)}
    with pytest.raises(ConfigError, match=r"tp_size 32 does not divide the 16 linear key heads"):
        sharded("qwen3_next_80b.json", 32)


def test_lightning_attention_splits_heads() -> None:
    rank = sharded("minimax_m1_80k.json", 8)
    assert states(rank, "linear") == {"kv": (8, 128, 128)}


def test_unverified_state_is_refused_by_family() -> None:
    with pytest.raises(ConfigError) as err:
        sharded("kimi_linear_48b.json", 2)
    message = str(err.value)
    assert message.startswith(
        "model.tp_size is 2 but kimi_linear's layer 0 (linear-attention layer) has no verified "
        "tensor-parallel split (state conv_q 4096x3, "
    )
    assert message.endswith("allowed: tp_size 1 for this model")
    with pytest.raises(ConfigError, match=r"lfm2's layer 0 \(short-conv layer\) has no verified"):
        sharded("lfm2_350m.json", 2)


def test_explicit_layer_lists_shard_their_global_heads() -> None:
    explicit = ExplicitLayout.model_validate(
        {
            "model_type": "custom",
            "layers": [
                {"kind": "full", "kv_heads": 8, "head_dim": 64},
                {"kind": "sliding", "kv_heads": 4, "head_dim": 64, "window_tokens": 128},
            ],
        }
    ).to_layout("test")
    layout = shard_layout(explicit, 4)
    assert (heads(layout), heads(layout, "sliding")) == (2, 1)


def test_bad_tp_sizes_and_double_sharding_are_refused() -> None:
    layout = load_layout(shared_model("llama-3.1-8b.json"))
    with pytest.raises(ConfigError, match=r"model.tp_size is 0; allowed: an integer 1..1024"):
        shard_layout(layout, 0)
    with pytest.raises(ConfigError, match=r"already one rank's share of tp_size 2"):
        shard_layout(shard_layout(layout, 2), 2)


def roots(layout: ModelLayout, tp_rank: int) -> dict[str, bytes]:
    layer_map = LayerMap(layout)
    dtypes = CacheDtypes.from_names("bfloat16")
    geometries = {g.name: GroupGeometry.of(g, dtypes, 16) for g in layer_map.groups}
    keyers = page_keyers(geometries, layer_map, "hybrid", model="m", tp_rank=tp_rank)
    return {name: keyer.root for name, keyer in keyers.items()}


def test_replicated_groups_share_keys_across_ranks_not_sizes() -> None:
    layout = load_layout(shared_model("deepseek_v32_exp.json"))
    assert layout.group("sparse").kind is CacheKind.SPARSE
    at_8 = shard_layout(layout, 8)
    assert roots(at_8, 0) == roots(at_8, 5)  # one object serves every rank
    # another tensor-parallel size computes the latent with another reduction order: its
    # bytes may differ in the last bits, so it is kept apart (as is a TP1 deployment)
    assert roots(at_8, 0) != roots(shard_layout(layout, 4), 0)
    assert roots(at_8, 0) != roots(layout, 0)


def test_per_rank_groups_key_rank_and_size() -> None:
    layout = load_layout(shared_model("llama-3.1-8b.json"))
    at_4 = shard_layout(layout, 4)
    assert roots(at_4, 0) != roots(at_4, 1)
    # rank 1 of 2 (head 1) and rank 1 of 16 (head 0, replicated) both hold one head of 128:
    # the size keeps them apart
    assert roots(shard_layout(layout, 8), 1) != roots(shard_layout(layout, 16), 1)
    assert roots(layout, 0) != roots(at_4, 0)


def test_a_rank_must_be_one_of_the_tp_size() -> None:
    from hicache.embedded import check_tp_rank

    check_tp_rank(1, 2, "EmbeddedCache.build")
    check_tp_rank(3, 1, "EmbeddedCache.build")  # tp_size 1: a hand-sharded deployment's rank
    with pytest.raises(ConfigError) as err:
        check_tp_rank(2, 2, "EmbeddedCache.build")
    assert str(err.value) == (
        "EmbeddedCache.build: tp_rank 2 is not a rank of the layout's tp_size 2 "
        "(model.tp_size); allowed: 0..1"
    )


def test_a_tensor_parallel_stack_must_say_its_rank() -> None:
    """Rank 0's keys on rank 1 would file rank 1's heads under rank 0's pages (and a later
    load on rank 0 would verify and serve them): a sharded stack built without a rank is
    refused, one built with it serves that rank."""
    import torch

    layer_map = LayerMap(shard_layout(load_layout(shared_model("llama-3.1-8b.json")), 2))
    kwargs: dict[str, Any] = {
        "dtype": torch.float16,
        "page_size_tokens": 16,
        "host_capacity_bytes": 64 << 20,
        "device_pages": 4,
    }
    with pytest.raises(ConfigError) as err:
        by_key.embedded(layer_map, **kwargs)
    assert str(err.value) == (
        "EmbeddedCache.build: the layout is one rank's share of model.tp_size 2; say which "
        "rank this stack serves (tp_rank=0..1)"
    )
    stack = by_key.embedded(layer_map, tp_rank=1, **kwargs)
    try:
        assert stack.tp_rank == 1
    finally:
        stack.close()
