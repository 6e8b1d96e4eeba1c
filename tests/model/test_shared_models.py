"""Every real config in configs/models against the layout derived by hand from each family's
rules (the expected values below are written from the config fields and the family's
documented defaults, not produced by the code under test)."""

from __future__ import annotations

import pytest

from hicache.model import CacheKind, KvFormat, LayerMap, load_layout
from tests.conftest import MODEL_CONFIGS, shared_model

F, S, C, X, L, M, V = "full", "sliding", "chunked", "sparse", "linear", "mamba", "conv"


def kinds_of(name: str) -> list[list[str]]:
    layout = load_layout(shared_model(name))
    return [[k.value for k in layer.kinds] for layer in layout.layers]


# Byte-identical copies kept under the deployment files' names.
TWINS = {
    "deepseek-v3.2-exp.json": "deepseek_v32_exp.json",
    "gpt-oss-20b.json": "gpt_oss_20b.json",
    "qwen3-next-80b.json": "qwen3_next_80b.json",
}


def test_every_real_config_is_covered() -> None:
    covered = {
        *TWINS,
        "gpt-oss-120b.json",
        "llama-3.1-8b.json",
        "deepseek_v32_exp.json",
        "falcon_h1_7b.json",
        "gemma3_27b.json",
        "gemma3n_e4b.json",
        "gpt_oss_20b.json",
        "jamba_v01.json",
        "kimi_linear_48b.json",
        "lfm2_350m.json",
        "llama4_scout.json",
        "minimax_m1_80k.json",
        "mistral_7b_v01.json",
        "mistral_7b_v03.json",
        "nemotron_h_8b.json",
        "qwen2_7b.json",
        "qwen3_next_80b.json",
    }
    assert {p.name for p in MODEL_CONFIGS.glob("*.json")} == covered
    for copy, original in TWINS.items():
        assert shared_model(copy).read_bytes() == shared_model(original).read_bytes()


def test_llama31_8b_all_full_gqa() -> None:
    layout = load_layout(shared_model("llama-3.1-8b.json"))
    assert kinds_of("llama-3.1-8b.json") == [[F]] * 32
    spec = layout.group("full").spec
    # head_dim is not in the config: 4096 / 32 heads
    assert (spec.num_kv_heads, spec.head_dim, spec.v_head_dim) == (8, 128, 128)


def test_gpt_oss_120b_alternates_over_36_layers() -> None:
    assert kinds_of("gpt-oss-120b.json") == [[S], [F]] * 18


def test_gemma3_27b_every_sixth_layer_full() -> None:
    # text_config has no sliding_window_pattern: the Gemma 3 default of 6 applies.
    layout = load_layout(shared_model("gemma3_27b.json"))
    assert layout.model_type == "gemma3"
    assert layout.num_layers == 62
    assert layout.full_attention_layer_ids == (5, 11, 17, 23, 29, 35, 41, 47, 53, 59)
    sliding = layout.group("sliding").spec
    assert (sliding.window_tokens, sliding.num_kv_heads, sliding.head_dim) == (1024, 16, 128)
    assert len(layout.group("sliding").layer_ids) == 52


def test_gpt_oss_alternates_sliding_and_full() -> None:
    assert kinds_of("gpt_oss_20b.json") == [[S], [F]] * 12
    layout = load_layout(shared_model("gpt_oss_20b.json"))
    assert layout.group("sliding").spec.window_tokens == 128
    assert layout.group("full").spec.head_dim == 64


def test_mistral_v01_slides_everywhere_and_v03_is_full() -> None:
    assert kinds_of("mistral_7b_v01.json") == [[S]] * 32
    assert (
        load_layout(shared_model("mistral_7b_v01.json")).group("sliding").spec.window_tokens == 4096
    )
    assert kinds_of("mistral_7b_v03.json") == [[F]] * 32


def test_qwen2_use_sliding_window_false_means_full() -> None:
    layout = load_layout(shared_model("qwen2_7b.json"))
    assert [[k.value for k in layer.kinds] for layer in layout.layers] == [[F]] * 28
    assert (layout.group("full").spec.num_kv_heads, layout.group("full").spec.head_dim) == (4, 128)


def test_llama4_scout_nope_every_fourth_layer_full_rest_chunked() -> None:
    # no_rope_layers is [] in the config: the default interval of 4 applies.
    assert kinds_of("llama4_scout.json") == [[C], [C], [C], [F]] * 12
    assert load_layout(shared_model("llama4_scout.json")).group("chunked").spec.chunk_tokens == 8192


def test_gemma3n_tail_layers_share_kv_with_last_of_same_type() -> None:
    layout = load_layout(shared_model("gemma3n_e4b.json"))
    assert layout.full_attention_layer_ids == (4, 9, 14, 19)
    for layer in layout.layers[:20]:
        assert layer.reuses is None
        assert layer.caches
    expected = {i: (19 if i in (24, 29, 34) else 18) for i in range(20, 35)}
    assert {layer.layer_id: layer.reuses for layer in layout.layers[20:]} == expected
    assert all(layer.kinds == () for layer in layout.layers[20:])


def test_qwen3_next_three_linear_then_full() -> None:
    assert kinds_of("qwen3_next_80b.json") == [[L], [L], [L], [F]] * 12
    layout = load_layout(shared_model("qwen3_next_80b.json"))
    linear = dict(layout.group("linear").spec.state_shapes)
    # conv over q, k, v: 2 * 16 * 128 + 32 * 128 = 8192 channels, kernel 4 keeps 3 columns
    assert linear == {"conv": (8192, 3), "recurrent": (32, 128, 128)}
    assert (layout.group("full").spec.num_kv_heads, layout.group("full").spec.head_dim) == (2, 256)


def test_minimax_m1_attn_type_list() -> None:
    assert kinds_of("minimax_m1_80k.json") == ([[L]] * 7 + [[F]]) * 10
    linear = load_layout(shared_model("minimax_m1_80k.json")).group("linear").spec
    assert dict(linear.state_shapes) == {"kv": (64, 128, 128)}


def test_kimi_linear_one_based_layer_lists() -> None:
    layout = load_layout(shared_model("kimi_linear_48b.json"))
    assert layout.full_attention_layer_ids == (3, 7, 11, 15, 19, 23, 26)
    full = layout.group("full").spec
    assert (full.kv_format, full.head_dim, full.v_head_dim) == (KvFormat.MLA, 512 + 64, None)
    assert dict(layout.group("linear").spec.state_shapes)["recurrent"] == (32, 128, 128)
    assert dict(layout.group("linear").spec.state_shapes)["conv_q"] == (32 * 128, 3)


def test_lfm2_conv_and_attention() -> None:
    full_ids = {2, 5, 8, 10, 12, 14}
    assert kinds_of("lfm2_350m.json") == [[F] if i in full_ids else [V] for i in range(16)]
    conv = load_layout(shared_model("lfm2_350m.json")).group("conv").spec
    # kernel conv_L_cache = 3 over hidden_size 1024 channels keeps the last 2 inputs (vLLM's
    # short-conv state; transformers keeps all 3 columns, one of which it never reads back)
    assert dict(conv.state_shapes) == {"conv": (1024, 2)}


def test_jamba_attention_every_eighth_from_four() -> None:
    assert kinds_of("jamba_v01.json") == ([[M]] * 4 + [[F]] + [[M]] * 3) * 4
    mamba = load_layout(shared_model("jamba_v01.json")).group("mamba").spec
    # Mamba-1: d_inner = 2 * 4096; conv keeps d_conv - 1 = 3 columns; ssm d_state 16
    assert dict(mamba.state_shapes) == {"conv": (8192, 3), "ssm": (8192, 16)}


def test_nemotron_h_pattern_string() -> None:
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    want = [{"M": [M], "*": [F], "-": []}[ch] for ch in pattern]
    assert kinds_of("nemotron_h_8b.json") == want
    layout = load_layout(shared_model("nemotron_h_8b.json"))
    assert layout.full_attention_layer_ids == (7, 18, 29, 40)
    # Mamba-2: d_inner 128 * 64 = 8192, conv_dim 8192 + 2 * 8 * 128 = 10240
    assert dict(layout.group("mamba").spec.state_shapes) == {
        "conv": (10240, 3),
        "ssm": (128, 64, 128),
    }


def test_falcon_h1_parallel_attention_and_mamba() -> None:
    layout = load_layout(shared_model("falcon_h1_7b.json"))
    assert all(layer.kinds == (CacheKind.FULL, CacheKind.MAMBA) for layer in layout.layers)
    assert layout.num_layers == 44
    # d_ssm 3072 + 2 * 1 * 256 = 3584 conv channels; 24 heads x 128 x d_state 256
    assert dict(layout.group("mamba").spec.state_shapes) == {
        "conv": (3584, 3),
        "ssm": (24, 128, 256),
    }
    assert (layout.group("full").spec.num_kv_heads, layout.group("full").spec.head_dim) == (2, 128)


def test_deepseek_v32_mla_with_index_k() -> None:
    layout = load_layout(shared_model("deepseek_v32_exp.json"))
    assert layout.num_layers == 61  # the MTP layer is not a decoder layer
    assert layout.full_attention_layer_ids == ()
    spec = layout.group("sparse").spec
    assert (spec.kv_format, spec.head_dim, spec.num_kv_heads) == (KvFormat.MLA, 576, 1)
    assert spec.index is not None
    assert (spec.index.head_dim, spec.index.has_v) == (128, False)
    layer_map = LayerMap(layout)
    assert layer_map.is_sparse_attention_layer(0)
    assert layer_map.is_index_k_layer(0)
    assert not layer_map.is_index_kv_layer(0)


@pytest.mark.parametrize("name", sorted(p.name for p in MODEL_CONFIGS.glob("*.json")))
def test_groups_partition_every_cache(name: str) -> None:
    layout = load_layout(shared_model(name))
    owned = sorted(
        (lid, c.kind) for layer in layout.layers for c in layer.caches for lid in [layer.layer_id]
    )
    grouped = sorted((lid, g.kind) for g in layout.groups for lid in g.layer_ids)
    assert owned == grouped
