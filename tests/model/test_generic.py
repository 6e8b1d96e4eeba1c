"""The generic rule for unknown model types: dense fallback, layer_types, the refusals (each
naming the field that suggests a cache the rule cannot size), and the `rule` line."""

from __future__ import annotations

import re
from typing import Any

import pytest

from hicache.errors import UnsupportedModelError
from hicache.model import LayerMap, layout_from_hf_config
from hicache.model.render import layout_json, layout_table

ATTN = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 4}
PLAIN = {"model_type": "brand_new_lm", "num_hidden_layers": 3, **ATTN}


def test_plain_attention_fields_give_a_dense_layout_and_say_so() -> None:
    layout = layout_from_hf_config(PLAIN, "x.json")
    assert [[k.value for k in layer.kinds] for layer in layout.layers] == [["full"]] * 3
    spec = layout.group("full").spec
    assert (spec.num_kv_heads, spec.head_dim, spec.v_head_dim) == (4, 128, 128)
    assert layout.rule == "generic dense fallback (model_type 'brand_new_lm' is not a known family)"
    data = layout_json(LayerMap(layout))
    assert data["rule"] == layout.rule
    table = layout_table(LayerMap(layout))
    assert "rule: generic dense fallback (model_type 'brand_new_lm' is not a known family)" in (
        table.splitlines()
    )


def test_dense_fallback_reads_head_dim_and_missing_kv_heads() -> None:
    cfg = {"model_type": "x", "num_hidden_layers": 2, "hidden_size": 1024}
    cfg |= {"num_attention_heads": 8, "head_dim": 96, "use_sliding_window": False}
    cfg |= {"sliding_window": 4096}  # disabled by use_sliding_window: false
    spec = layout_from_hf_config(cfg).group("full").spec
    assert (spec.num_kv_heads, spec.head_dim) == (8, 96)


def test_layer_types_alone_give_the_layer_count() -> None:
    cfg = {"model_type": "resaved", **ATTN, "sliding_window": 128}
    cfg["layer_types"] = ["sliding_attention", "sliding_attention", "full_attention"]
    layout = layout_from_hf_config(cfg)
    assert layout.num_layers == 3
    assert layout.full_attention_layer_ids == (2,)
    assert layout.rule.startswith("generic layer_types rule")


def test_per_layer_config_overrides_are_read() -> None:
    cfg: dict[str, Any] = {**PLAIN, "per_layer_config": {"2": {"head_dim": 256}}}
    layout = layout_from_hf_config(cfg)
    assert [g.spec.head_dim for g in layout.groups] == [128, 256]
    assert layout.groups[1].layer_ids == (2,)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"mamba_d_state": 16}, "field 'mamba_d_state' is 16"),
        ({"linear_num_key_heads": 16}, "field 'linear_num_key_heads' is 16"),
        ({"kv_lora_rank": 512}, "field 'kv_lora_rank' is 512"),
        ({"sliding_window": 4096}, "field 'sliding_window' is 4096 but no 'layer_types' says"),
        ({"attention_chunk_size": 8192}, "field 'attention_chunk_size' is 8192 but no"),
        ({"sliding_window_pattern": 6}, "field 'sliding_window_pattern' is 6"),
        ({"num_kv_shared_layers": 2}, "field 'num_kv_shared_layers' is 2 (KV sharing)"),
        ({"layers_block_type": ["mamba"] * 3}, "field 'layers_block_type' is ['mamba'"),
        ({"v_head_dim": 64}, "field 'v_head_dim' is 64 (a separate V width)"),
        ({"layer_types": ["full_attention", "conv", "full_attention"]}, "layer_types[1] is 'conv'"),
        (
            {"use_sliding_window": True, "sliding_window": 512, "max_window_layers": 2},
            "field 'max_window_layers' is 2",
        ),
    ],
)
def test_hybrid_hints_are_refused_naming_the_field(extra: dict[str, Any], named: str) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        layout_from_hf_config({**PLAIN, **extra}, "x.json")
    message = str(info.value)
    assert message.startswith(
        f"model_type 'brand_new_lm' (x.json) is not a supported family and its {named}"
    )
    assert (
        "which the generic rule cannot read (it reads hidden_size, num_attention_heads" in message
    )
    assert "chunked_attention / full_attention / sliding_attention)" in message
    assert "layers:\n    - {repeat: 3, kind: sliding" in message


def test_no_attention_fields_lists_families_and_example() -> None:
    with pytest.raises(UnsupportedModelError) as info:
        layout_from_hf_config({"model_type": "mystery", "num_hidden_layers": 2}, "x.json")
    message = str(info.value)
    assert re.match(
        r"^model_type 'mystery' \(x\.json\) is not a supported family and its config has no "
        r"'num_attention_heads' for the generic rule",
        message,
    )
    assert "gemma3, gemma3_text" in message
    assert "qwen3_next" in message
    assert "layers:\n    - {repeat: 3, kind: sliding" in message


def test_known_families_name_their_rule() -> None:
    layout = layout_from_hf_config({"model_type": "gemma3_text", "num_hidden_layers": 6, **ATTN})
    assert layout.rule == "family rule 'gemma3' (model_type 'gemma3_text')"
    layout = layout_from_hf_config({"model_type": "llama", "num_hidden_layers": 1, **ATTN})
    assert layout.rule == "family rule 'llama'"


def test_pattern_fields_beside_a_layer_types_list_only_restate_it() -> None:
    cfg = {**PLAIN, "sliding_window": 64, "sliding_window_pattern": 2}
    cfg["layer_types"] = ["sliding_attention", "full_attention", "full_attention"]
    layout = layout_from_hf_config(cfg)
    assert layout.full_attention_layer_ids == (1, 2)
    with pytest.raises(UnsupportedModelError, match=r"its field 'sliding_window' is 64 but no"):
        layout_from_hf_config({k: v for k, v in cfg.items() if k != "layer_types"})
