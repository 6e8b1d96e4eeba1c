"""Families without a config in ../shared/models, from the fields their released checkpoints
carry, plus the generic fallback and the unsupported-model error."""

from __future__ import annotations

import re
from typing import Any

import pytest

from hicache.errors import LayoutError, UnsupportedModelError
from hicache.model import CacheKind, KvFormat, layout_from_hf_config

F, S, C, X, L, M, V = "full", "sliding", "chunked", "sparse", "linear", "mamba", "conv"


def kinds(config: dict[str, Any]) -> list[list[str]]:
    return [[k.value for k in layer.kinds] for layer in layout_from_hf_config(config).layers]


ATTN = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 4}


def test_llama_and_glm4_all_full() -> None:
    assert kinds({"model_type": "llama", "num_hidden_layers": 4, **ATTN}) == [[F]] * 4
    assert (
        kinds({"model_type": "glm4", "num_hidden_layers": 3, **ATTN, "head_dim": 128}) == [[F]] * 3
    )


def test_qwen3_sliding_only_above_max_window_layers() -> None:
    cfg = {
        "model_type": "qwen3",
        "num_hidden_layers": 6,
        **ATTN,
        "head_dim": 128,
        "use_sliding_window": True,
        "sliding_window": 4096,
        "max_window_layers": 4,
    }
    assert kinds(cfg) == [[F]] * 4 + [[S]] * 2


def test_smollm3_and_mimo_follow_the_qwen_rule() -> None:
    for model_type in ("smollm3", "mimo"):
        cfg = {
            "model_type": model_type,
            "num_hidden_layers": 3,
            **ATTN,
            "use_sliding_window": False,
            "sliding_window": None,
        }
        assert kinds(cfg) == [[F]] * 3


def test_ministral_layer_types_win() -> None:
    cfg = {
        "model_type": "ministral",
        "num_hidden_layers": 4,
        **ATTN,
        "sliding_window": 32768,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }
    assert kinds(cfg) == [[S], [F]] * 2


def test_gemma2_default_alternation() -> None:
    cfg = {
        "model_type": "gemma2",
        "num_hidden_layers": 4,
        "hidden_size": 2304,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 4096,
    }
    assert kinds(cfg) == [[S], [F]] * 2


def test_cohere2_every_fourth_full() -> None:
    cfg = {
        "model_type": "cohere2",
        "num_hidden_layers": 8,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "sliding_window_pattern": 4,
    }
    assert kinds(cfg) == [[S], [S], [S], [F]] * 2
    assert layout_from_hf_config(cfg).group("full").spec.head_dim == 128


def test_olmo3_every_fourth_full() -> None:
    cfg = {"model_type": "olmo3", "num_hidden_layers": 8, **ATTN, "sliding_window": 4096}
    assert kinds(cfg) == [[S], [S], [S], [F]] * 2


def test_exaone4_string_and_int_patterns_and_null_window() -> None:
    base = {"model_type": "exaone4", "num_hidden_layers": 8, **ATTN, "sliding_window": 4096}
    assert kinds({**base, "sliding_window_pattern": "LLLG"}) == [[S], [S], [S], [F]] * 2
    assert kinds({**base, "sliding_window_pattern": 2}) == [[S], [F]] * 4
    assert kinds({**base, "sliding_window": None}) == [[F]] * 8
    with pytest.raises(
        LayoutError,
        match=r"^exaone4 config: field 'sliding_window_pattern' "
        r"is 'LXG'; allowed: a positive integer or a string of 'L' and 'G'",
    ):
        layout_from_hf_config({**base, "sliding_window_pattern": "LXG"})


def test_gemma4_global_geometry_k_eq_v_and_kv_sharing() -> None:
    text = {
        "model_type": "gemma4_text",
        "num_hidden_layers": 12,
        "hidden_size": 2560,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "num_global_key_value_heads": 1,
        "global_head_dim": 512,
        "attention_k_eq_v": True,
        "sliding_window": 512,
        "num_kv_shared_layers": 4,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2,
    }
    layout = layout_from_hf_config({"model_type": "gemma4", "text_config": text})
    assert layout.model_type == "gemma4"
    full = layout.group("full").spec
    assert (full.num_kv_heads, full.head_dim, full.v_head_dim) == (1, 512, None)
    assert full.token_tensors() == (("k", (1, 512)),)
    # layers 8..11 share: 8, 9, 10 read sliding layer 7; 11 reads full layer 5
    assert [layer.reuses for layer in layout.layers[8:]] == [7, 7, 7, 5]


def test_qwen3_5_wrapper_uses_text_config() -> None:
    text = {
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 8,
        "hidden_size": 4096,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
    }
    layout = layout_from_hf_config({"model_type": "qwen3_5", "text_config": text})
    assert [[k.value for k in layer.kinds] for layer in layout.layers] == [[L], [L], [L], [F]] * 2


def test_minimax_m2_all_full_and_rejects_linear_flags() -> None:
    cfg = {
        "model_type": "minimax_m2",
        "num_hidden_layers": 4,
        "hidden_size": 3072,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
    }
    assert kinds(cfg) == [[F]] * 4
    with pytest.raises(
        LayoutError,
        match=r"^minimax_m2 config: attn_type_list \[1, 0, 1, 1\] has "
        r"linear layers \(0\); minimax_m2 allows only 1",
    ):
        layout_from_hf_config({**cfg, "attn_type_list": [1, 0, 1, 1]})


def test_deepseek_v3_and_glm5() -> None:
    v3 = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 3,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "num_attention_heads": 128,
    }
    spec = layout_from_hf_config(v3).group("full").spec
    assert (spec.kv_format, spec.head_dim) == (KvFormat.MLA, 576)
    glm5 = {
        "model_type": "glm_moe_dsa",
        "num_hidden_layers": 4,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "index_head_dim": 128,
        "index_topk": 2048,
    }
    assert kinds(glm5) == [[X]] * 4


def test_bamba_attention_indices() -> None:
    cfg = {
        "model_type": "bamba",
        "num_hidden_layers": 6,
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "attn_layer_indices": [2, 5],
        "mamba_n_heads": 32,
        "mamba_d_head": 64,
        "mamba_n_groups": 1,
        "mamba_d_state": 128,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    }
    assert kinds(cfg) == [[M], [M], [F], [M], [M], [F]]
    shapes = dict(layout_from_hf_config(cfg).group("mamba").spec.state_shapes)
    assert shapes == {"conv": (2048 + 2 * 128, 3), "ssm": (32, 64, 128)}


def test_granite_hybrid_layer_types_and_auto_head_dim() -> None:
    cfg = {
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 4,
        "hidden_size": 1536,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "layer_types": ["mamba", "mamba", "mamba", "attention"],
        "mamba_n_heads": 48,
        "mamba_d_head": "auto",
        "mamba_n_groups": 1,
        "mamba_d_state": 128,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    }
    assert kinds(cfg) == [[M], [M], [M], [F]]
    assert dict(layout_from_hf_config(cfg).group("mamba").spec.state_shapes)["ssm"] == (48, 64, 128)


def test_zamba2_hybrid_layers_own_attention_and_mamba() -> None:
    cfg = {
        "model_type": "zamba2",
        "num_hidden_layers": 4,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
        "mamba_d_state": 64,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_ngroups": 1,
        "mamba_headdim": 64,
    }
    assert kinds(cfg) == [[M], [F, M], [M], [F, M]]
    layout = layout_from_hf_config(cfg)
    assert layout.group("full").spec.head_dim == 2 * 2048 // 32
    assert dict(layout.group("mamba").spec.state_shapes)["ssm"] == (64, 64, 64)


def test_phi4flash_sambay_yoco() -> None:
    cfg = {
        "model_type": "phi4flash",
        "num_hidden_layers": 32,
        "hidden_size": 2560,
        "num_attention_heads": 40,
        "num_key_value_heads": 20,
        "sliding_window": 512,
        "mb_per_layer": 2,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    }
    layout = layout_from_hf_config(cfg)
    got = [[k.value for k in layer.kinds] for layer in layout.layers]
    want = [[M] if i % 2 == 0 else [S] for i in range(16)] + [[M], [F]] + [[]] * 14
    assert got == want
    assert [layer.reuses for layer in layout.layers[19::2]] == [17] * 7
    assert all(layer.reuses is None for layer in layout.layers[18::2])


def test_llama4_explicit_no_rope_layers_and_no_chunking() -> None:
    text = {
        "model_type": "llama4_text",
        "num_hidden_layers": 4,
        **ATTN,
        "no_rope_layers": [1, 0, 1, 0],
        "attention_chunk_size": 8192,
    }
    assert kinds({"model_type": "llama4", "text_config": text}) == [[C], [F], [C], [F]]
    text["attention_chunk_size"] = None
    assert kinds({"model_type": "llama4", "text_config": text}) == [[F]] * 4


def test_unknown_model_with_layer_types_uses_generic_rule() -> None:
    cfg = {
        "model_type": "brand_new",
        "num_hidden_layers": 2,
        **ATTN,
        "sliding_window": 256,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    assert kinds(cfg) == [[S], [F]]
    cfg2 = {
        "model_type": "other_new",
        "num_hidden_layers": 2,
        **ATTN,
        "sliding_window": 256,
        "use_sliding_window": True,
    }
    assert kinds(cfg2) == [[S], [S]]


def test_unknown_model_with_chunked_layer_types() -> None:
    cfg = {
        "model_type": "chunky",
        "num_hidden_layers": 2,
        **ATTN,
        "attention_chunk_size": 512,
        "layer_types": ["chunked_attention", "full_attention"],
    }
    layout = layout_from_hf_config(cfg)
    assert [[k.value for k in layer.kinds] for layer in layout.layers] == [[C], [F]]
    assert layout.group("chunked").spec.chunk_tokens == 512


def test_unknown_model_without_generic_fields_lists_families_and_example() -> None:
    with pytest.raises(UnsupportedModelError) as info:
        layout_from_hf_config({"model_type": "mystery", "num_hidden_layers": 2, **ATTN}, "x.json")
    message = str(info.value)
    assert re.match(
        r"^model_type 'mystery' \(x\.json\) is not a supported family and its "
        r"config has no generic 'layer_types'",
        message,
    )
    assert "gemma3, gemma3_text" in message
    assert "qwen3_next" in message
    assert "layers:\n    - {repeat: 3, kind: sliding" in message


def test_bad_fields_name_field_value_and_allowed() -> None:
    with pytest.raises(
        LayoutError,
        match=r"^llama config: field 'num_hidden_layers' is 'two'; "
        r"allowed: an integer >= 1$",
    ):
        layout_from_hf_config({"model_type": "llama", "num_hidden_layers": "two", **ATTN})
    with pytest.raises(
        LayoutError,
        match=r"^gpt_oss config: field 'layer_types' has 1 entries; "
        r"it must have one per layer \(num_hidden_layers = 2\)$",
    ):
        layout_from_hf_config(
            {
                "model_type": "gpt_oss",
                "num_hidden_layers": 2,
                **ATTN,
                "layer_types": ["full_attention"],
            }
        )
    with pytest.raises(
        LayoutError,
        match=r"^gpt_oss config: layer_types\[1\] is 'weird'; "
        r"allowed for this family: \['full_attention', 'sliding_attention'\]$",
    ):
        layout_from_hf_config(
            {
                "model_type": "gpt_oss",
                "num_hidden_layers": 2,
                **ATTN,
                "layer_types": ["full_attention", "weird"],
            }
        )
    with pytest.raises(LayoutError, match=r"^model config has no 'model_type'"):
        layout_from_hf_config({"num_hidden_layers": 2})
    with pytest.raises(
        LayoutError,
        match=r"^minimax config: neither 'layer_types' nor "
        r"'attn_type_list' is set",
    ):
        layout_from_hf_config({"model_type": "minimax", "num_hidden_layers": 2, **ATTN})


def test_token_tensors_shapes() -> None:
    cfg = {"model_type": "llama", "num_hidden_layers": 1, **ATTN}
    spec = layout_from_hf_config(cfg).group("full").spec
    assert spec.kind is CacheKind.FULL
    assert spec.token_tensors() == (("k", (4, 128)), ("v", (4, 128)))
