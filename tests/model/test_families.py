"""Families without a config in configs/models, from the fields their released checkpoints
carry, and the rules checked by hand against transformers 5.19's config and model code (the
generic rule for unknown model types is in test_generic.py)."""

from __future__ import annotations

from typing import Any

import pytest

from hicache.errors import LayoutError
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
    # attention_k_eq_v: V is projected by K's weights, but the cached V (normed, no RoPE)
    # is not the cached K (normed, RoPE'd), so transformers and vLLM both keep it
    assert (full.num_kv_heads, full.head_dim, full.v_head_dim) == (1, 512, 512)
    assert full.token_tensors() == (("k", (1, 512)), ("v", (1, 512)))
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


# ---- rules checked against transformers 5.19's code, derived by hand -------------------------


def test_sliding_rules_of_the_qwen_family_differ_per_model_type() -> None:
    base = {"num_hidden_layers": 6, **ATTN, "use_sliding_window": True, "sliding_window": 64}
    # qwen2 / qwen3: layers >= max_window_layers slide
    assert kinds({"model_type": "qwen3", **base, "max_window_layers": 4}) == [[F]] * 4 + [[S]] * 2
    # qwen2_moe: even layers below max_window_layers slide
    assert kinds({"model_type": "qwen2_moe", **base, "max_window_layers": 4}) == [
        [S],
        [F],
        [S],
        [F],
        [F],
        [F],
    ]
    # qwen3_moe: every layer (it has no max_window_layers)
    assert kinds({"model_type": "qwen3_moe", **base}) == [[S]] * 6
    # smollm3: the NoPE layers (every no_rope_layer_interval-th) slide
    assert (
        kinds({"model_type": "smollm3", **base, "no_rope_layer_interval": 3})
        == [
            [F],
            [F],
            [S],
        ]
        * 2
    )
    assert kinds({"model_type": "qwen3_moe", **base, "use_sliding_window": False}) == [[F]] * 6


def test_phi3_slides_every_layer_when_sliding_window_is_set() -> None:
    cfg = {"model_type": "phi3", "num_hidden_layers": 2, **ATTN, "sliding_window": 2047}
    assert kinds(cfg) == [[S]] * 2
    assert kinds({**cfg, "sliding_window": None}) == [[F]] * 2


def test_plain_full_families_added() -> None:
    for model_type in ("apertus", "seed_oss", "ernie4_5", "ernie4_5_moe"):
        layout = layout_from_hf_config({"model_type": model_type, "num_hidden_layers": 2, **ATTN})
        assert layout.rule == f"family rule 'llama' (model_type {model_type!r})"
        assert [[k.value for k in layer.kinds] for layer in layout.layers] == [[F]] * 2


def test_mimo_v2_flash_hub_fields_k_and_v_dims_and_swa_heads() -> None:
    cfg = {
        "model_type": "mimo_v2_flash",
        "num_hidden_layers": 6,
        "hidden_size": 4096,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 192,
        "v_head_dim": 128,
        "swa_num_attention_heads": 64,
        "swa_num_key_value_heads": 8,
        "swa_head_dim": 192,
        "swa_v_head_dim": 128,
        "sliding_window": 128,
        "hybrid_layer_pattern": [0, 1, 1, 1, 1, 0],
    }
    layout = layout_from_hf_config(cfg)
    assert kinds(cfg) == [[F], [S], [S], [S], [S], [F]]
    full, swa = layout.group("full").spec, layout.group("sliding").spec
    assert full.token_tensors() == (("k", (4, 192)), ("v", (4, 128)))
    assert swa.token_tensors() == (("k", (8, 192)), ("v", (8, 128)))
    assert swa.window_tokens == 128
    # without swa_* fields, sliding layers have twice the KV heads (transformers' rule)
    plain = {k: v for k, v in cfg.items() if not k.startswith("swa_")}
    assert layout_from_hf_config(plain).group("sliding").spec.num_kv_heads == 8
    with pytest.raises(LayoutError, match=r"hybrid_layer_pattern holds 2; allowed: 1 \(sliding\)"):
        layout_from_hf_config({**cfg, "hybrid_layer_pattern": [0, 2, 1, 1, 1, 0]})


def test_gemma4_global_kv_heads_only_with_k_eq_v_and_last_layer_full() -> None:
    text = {
        "model_type": "gemma4_text",
        "num_hidden_layers": 4,
        "hidden_size": 1536,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": 4,
        "attention_k_eq_v": False,
        "sliding_window": 512,
        "layer_types": ["sliding_attention"] * 4,
    }
    layout = layout_from_hf_config(text)
    assert kinds(text) == [[S], [S], [S], [F]]
    full = layout.group("full").spec
    assert (full.num_kv_heads, full.head_dim, full.v_head_dim) == (1, 512, 512)
    # a re-saved config: per_layer_config replaces the global_* fields
    resaved = {k: v for k, v in text.items() if "global" not in k}
    resaved["per_layer_config"] = {"3": {"head_dim": 384, "num_key_value_heads": 2}}
    full = layout_from_hf_config(resaved).group("full").spec
    assert (full.num_kv_heads, full.head_dim) == (2, 384)


def test_nemotron_h_resaved_list_and_legacy_mamba_names() -> None:
    cfg: dict[str, Any] = {
        "model_type": "nemotron_h",
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "mamba_num_heads": 16,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
        "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"],
    }
    assert kinds(cfg) == [[M], [], [F], []]
    shapes = dict(layout_from_hf_config(cfg).group("mamba").spec.state_shapes)
    assert shapes == {"conv": (1024 + 2 * 8 * 128, 3), "ssm": (16, 64, 128)}
    # the hub's mamba_n_groups / mamba_d_conv win, as transformers pops them first
    legacy = {**cfg, "mamba_n_groups": 2, "mamba_d_conv": 3}
    shapes = dict(layout_from_hf_config(legacy).group("mamba").spec.state_shapes)
    assert shapes["conv"] == (1024 + 2 * 2 * 128, 2)
    with pytest.raises(LayoutError, match=r"hybrid_override_pattern holds 'X'; allowed"):
        layout_from_hf_config({**cfg, "layers_block_type": None, "hybrid_override_pattern": "M*X"})


def test_kimi_linear_resaved_fields_and_default_pattern() -> None:
    cfg = {
        "model_type": "kimi_linear",
        "num_hidden_layers": 9,
        "hidden_size": 2304,
        "num_attention_heads": 32,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "linear_num_heads": 16,
        "linear_head_dim": 64,
        "linear_conv_kernel_dim": 3,
    }
    layout = layout_from_hf_config(cfg)
    assert layout.full_attention_layer_ids == (4, 8)  # no list: full when i and i % 4 == 0
    shapes = dict(layout.group("linear").spec.state_shapes)
    assert shapes == {
        "conv_q": (1024, 2),
        "conv_k": (1024, 2),
        "conv_v": (1024, 2),
        "recurrent": (16, 64, 64),
    }
    # the checkpoint's linear_attn_config wins over the top-level fields, as in transformers
    block = {"num_heads": 8, "head_dim": 32, "short_conv_kernel_size": 4}
    shapes = dict(
        layout_from_hf_config({**cfg, "linear_attn_config": block})
        .group("linear")
        .spec.state_shapes
    )
    assert shapes["conv_q"] == (256, 3)
    assert shapes["recurrent"] == (8, 32, 32)
    with pytest.raises(LayoutError, match=r"must split the 1-based layer numbers 1\.\.9"):
        layout_from_hf_config(
            {**cfg, "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3]}}
        )


def test_lfm2_defaults_and_lfm2_moe_needs_layer_types() -> None:
    cfg = {"model_type": "lfm2", "num_hidden_layers": 2, **ATTN, "conv_L_cache": 3}
    assert kinds(cfg) == [[F]] * 2  # no full_attn_idxs: every layer attention
    assert kinds({**cfg, "full_attn_idxs": [1]}) == [[V], [F]]
    conv = layout_from_hf_config({**cfg, "full_attn_idxs": [1]}).group("conv").spec
    assert dict(conv.state_shapes) == {"conv": (2048, 2)}
    with pytest.raises(LayoutError, match=r"^lfm2_moe config: field 'layer_types' is missing"):
        layout_from_hf_config({**cfg, "model_type": "lfm2_moe"})


def test_zamba2_heads_from_n_mamba_heads_and_inconsistency() -> None:
    cfg = {
        "model_type": "zamba2",
        "num_hidden_layers": 2,
        "hidden_size": 2560,
        "num_attention_heads": 32,
        "layers_block_type": ["linear_attention", "hybrid"],
        "n_mamba_heads": 80,
        "mamba_headdim": 64,
    }
    layout = layout_from_hf_config(cfg)
    assert dict(layout.group("mamba").spec.state_shapes)["ssm"] == (80, 64, 64)
    assert layout.group("full").spec.head_dim == 160
    with pytest.raises(LayoutError, match=r"n_mamba_heads 80 and mamba_headdim 32 do not split"):
        layout_from_hf_config({**cfg, "mamba_headdim": 32})


def test_pure_mamba_models() -> None:
    m1 = {"model_type": "falcon_mamba", "num_hidden_layers": 3, "hidden_size": 4096}
    m1 |= {"state_size": 16, "expand": 2, "conv_kernel": 4}
    assert kinds(m1) == [[M]] * 3
    spec = layout_from_hf_config(m1).group("mamba").spec
    assert dict(spec.state_shapes) == {"conv": (8192, 3), "ssm": (8192, 16)}
    m2 = {"model_type": "mamba2", "num_hidden_layers": 2, "hidden_size": 4096}
    m2 |= {"num_heads": 128, "head_dim": 64, "state_size": 128, "n_groups": 8}
    spec = layout_from_hf_config(m2).group("mamba").spec
    assert dict(spec.state_shapes) == {"conv": (8192 + 2 * 8 * 128, 3), "ssm": (128, 64, 128)}
    assert layout_from_hf_config(m2).full_attention_layer_ids == ()


def test_olmo_hybrid_defaults() -> None:
    cfg = {"model_type": "olmo_hybrid", "num_hidden_layers": 8, "hidden_size": 3840}
    cfg |= {"num_attention_heads": 30}
    layout = layout_from_hf_config(cfg)
    assert layout.full_attention_layer_ids == (3, 7)
    # 30 heads; key head dim int(0.75 * 3840 / 30) = 96, value head dim 192
    shapes = dict(layout.group("linear").spec.state_shapes)
    assert shapes == {"conv": (2 * 30 * 96 + 30 * 192, 3), "recurrent": (30, 96, 192)}


def test_longcat_flash_two_mla_sublayers_per_block() -> None:
    cfg = {"model_type": "longcat_flash", "num_layers": 3, "kv_lora_rank": 512}
    cfg |= {"qk_rope_head_dim": 64}
    layout = layout_from_hf_config(cfg)
    assert layout.num_layers == 6
    assert layout.group("full").spec.head_dim == 576
    assert (
        layout_from_hf_config({**cfg, "num_layers": None, "num_hidden_layers": 8}).num_layers == 8
    )


def test_layer_count_from_lists_and_per_layer_config_errors() -> None:
    with pytest.raises(
        LayoutError,
        match=r"^llama config: field 'num_hidden_layers' is missing and no per-layer list "
        r"\('layer_types' or 'layers_block_type'\) gives the count",
    ):
        layout_from_hf_config({"model_type": "llama", **ATTN})
    cfg: dict[str, Any] = {"model_type": "llama", "num_hidden_layers": 2, **ATTN}
    with pytest.raises(
        LayoutError, match=r"per_layer_config key '7' is not a layer index; allowed: 0\.\.1$"
    ):
        layout_from_hf_config({**cfg, "per_layer_config": {"7": {"head_dim": 64}}})
    with pytest.raises(LayoutError, match=r"per_layer_config\['1'\] skips \['self_attn'\]"):
        layout_from_hf_config({**cfg, "per_layer_config": {"1": {"skip": ["self_attn"]}}})
    layout = layout_from_hf_config({**cfg, "per_layer_config": {"01": {"num_key_value_heads": 1}}})
    assert [g.spec.num_kv_heads for g in layout.groups] == [4, 1]


def test_jamba_ignores_sliding_window() -> None:
    cfg = {"model_type": "jamba", "num_hidden_layers": 2, **ATTN, "sliding_window": 4096}
    cfg |= {"attn_layer_period": 2, "attn_layer_offset": 1}
    assert kinds(cfg) == [[M], [F]]
