"""hicache's layouts against what transformers' own model code builds.

For each family rule: a tiny config is built with transformers (`AutoConfig.for_model`),
re-saved the way transformers 5.x writes config.json (`save_pretrained`: `layer_types` lists,
legacy names remapped, `num_hidden_layers` dropped where the list gives it, per-layer
overrides in `per_layer_config`), and a tiny random model built from it runs one short
forward with `use_cache=True` on the CPU. The cache the model filled is the ground truth:
per layer, which cache class it made (full, sliding/chunked window, linear/conv/SSM state or
nothing), the K and V head counts and dims, the window, and the state tensor shapes.

Both the re-saved config.json and the hub-style fields the config was built from must give
a hicache layout that matches it. One convention differs on purpose and is normalised here:
transformers' causal-conv states keep `kernel` columns, hicache (like vLLM and SGLang, whose
pools it copies) keeps `kernel - 1`. Kimi's KDA conv is one tensor in transformers and
three (q, k, v; as SGLang keeps them) in hicache: their channels are summed. MLA caches the
latent: transformers keeps it as K (kv_lora_rank) plus V (rope dims), hicache as one width;
DeepSeek Sparse Attention adds an indexer key per token on both sides.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hicache.errors import UnsupportedModelError
from hicache.model import CacheKind, KvFormat, ModelLayout, layout_from_hf_config
from tests.conftest import MODEL_CONFIGS, shared_model

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed; these checks compare against it"
)
torch = pytest.importorskip("torch", reason="the tiny reference models need torch")

Row = tuple[tuple[Any, ...], ...]

T = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
}
A = {**T, "num_hidden_layers": 4, "head_dim": 16}
MLA = {"kv_lora_rank": 16, "q_lora_rank": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8}
MLA |= {"v_head_dim": 12, "num_key_value_heads": 4}
MAMBA2 = {"mamba_n_heads": 4, "mamba_d_head": 32, "mamba_n_groups": 2, "mamba_d_state": 8}
MAMBA2 |= {"mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 4}
GDN = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8}
GDN |= {"linear_value_head_dim": 12}
MOE = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16}
DSA = {"n_routed_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16}
DSA |= {"first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "index_head_dim": 16}
DSA |= {"index_n_heads": 2, "index_topk": 4}


@dataclass(frozen=True)
class Case:
    model_type: str
    fields: dict[str, Any]
    mla: bool = False
    # no family rule: the generic rule reads the re-saved `layer_types` and must refuse the
    # hub-style fields, whose sliding pattern only the family's code knows
    generic: bool = False


CASES: dict[str, Case] = {
    # softmax attention
    "llama": Case("llama", A),
    "apertus": Case("apertus", A),
    "seed_oss": Case("seed_oss", A),
    "ernie4_5": Case("ernie4_5", A),
    "ernie4_5_moe": Case(
        "ernie4_5_moe", {**A, "moe_num_experts": 2, "moe_k": 1, "moe_intermediate_size": 16}
    ),
    "glm": Case("glm", A),
    "glm4": Case("glm4", A),
    "granite": Case("granite", A),
    "granitemoe": Case("granitemoe", {**A, "num_local_experts": 2, "num_experts_per_tok": 1}),
    "olmo2": Case("olmo2", A),
    "glm4_moe": Case(
        "glm4_moe",
        {**A, "n_routed_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16},
    ),
    "mistral": Case("mistral", {**A, "sliding_window": 8}),
    "mistral/no_window": Case("mistral", {**A, "sliding_window": None}),
    "ministral": Case(
        "ministral",
        {**A, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2},
    ),
    "phi3": Case("phi3", {**A, "sliding_window": 8}),
    "qwen2": Case(
        "qwen2", {**A, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}
    ),
    "qwen2/off": Case("qwen2", {**A, "use_sliding_window": False, "sliding_window": 8}),
    "qwen2_moe": Case(
        "qwen2_moe",
        {**A, **MOE, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3}
        | {"shared_expert_intermediate_size": 16},
    ),
    "qwen3": Case(
        "qwen3", {**A, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}
    ),
    "qwen3_moe": Case(
        "qwen3_moe",
        {**A, **MOE, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
    ),
    "smollm3": Case(
        "smollm3",
        {**A, "use_sliding_window": True, "sliding_window": 8, "no_rope_layer_interval": 2},
    ),
    "gemma2": Case("gemma2", {**A, "sliding_window": 8}),
    "gemma3_text": Case(
        "gemma3_text",
        {**A, "num_hidden_layers": 6, "sliding_window": 8, "sliding_window_pattern": 3},
    ),
    "cohere2": Case("cohere2", {**A, "sliding_window": 8, "sliding_window_pattern": 2}),
    "olmo3": Case("olmo3", {**A, "sliding_window": 8}),
    "gpt_oss": Case(
        "gpt_oss", {**A, "sliding_window": 8, "num_local_experts": 2, "num_experts_per_tok": 1}
    ),
    "exaone4": Case("exaone4", {**A, "sliding_window": 8, "sliding_window_pattern": 2}),
    "llama4_text": Case(
        "llama4_text",
        {**A, "attention_chunk_size": 8, "no_rope_layer_interval": 2}
        | {"num_local_experts": 2, "intermediate_size_mlp": 64},
    ),
    "minimax_m2": Case("minimax_m2", {**A, "num_local_experts": 2, "num_experts_per_tok": 1}),
    "mimo_v2_flash": Case(
        "mimo_v2_flash",
        {**A, "num_hidden_layers": 6, "head_dim": 24, "v_head_dim": 12, "sliding_window": 8}
        | {"n_routed_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16},
    ),
    "gemma3n_text": Case(
        "gemma3n_text",
        {**A, "num_hidden_layers": 6, "sliding_window": 8, "num_kv_shared_layers": 2}
        | {"layer_types": ["sliding_attention", "full_attention"] * 3}
        | {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 100}
        | {"laurel_rank": 4, "activation_sparsity_pattern": [0.0] * 6, "altup_num_inputs": 2},
    ),
    "gemma4_text/k_eq_v": Case(
        "gemma4_text",
        {**A, "num_hidden_layers": 6, "sliding_window": 8, "num_kv_shared_layers": 2}
        | {"layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}
        | {"global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True}
        | {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 100},
    ),
    "gemma4_text/plain": Case(
        "gemma4_text",
        {**A, "num_hidden_layers": 6, "sliding_window": 8}
        | {"global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": False}
        | {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 100},
    ),
    # no family rule: the generic layer_types rule
    "afmoe (generic)": Case(
        "afmoe", {**A, "sliding_window": 8, "global_attn_every_n_layers": 2, **MOE}, generic=True
    ),
    "exaone_moe (generic)": Case(
        "exaone_moe",
        {**A, "sliding_window": 8, "sliding_window_pattern": 2, **MOE}
        | {"first_k_dense_replace": 1, "num_shared_experts": 1},
        generic=True,
    ),
    "cohere2_moe (generic)": Case("cohere2_moe", {**A, "sliding_window": 8, **MOE}, generic=True),
    # MLA
    "deepseek_v3": Case(
        "deepseek_v3",
        {**T, **MLA, "num_hidden_layers": 2, "n_routed_experts": 2, "num_experts_per_tok": 1}
        | {"moe_intermediate_size": 16, "first_k_dense_replace": 1, "n_group": 1}
        | {"topk_group": 1},
        mla=True,
    ),
    "deepseek_v2": Case(
        "deepseek_v2",
        {**T, **MLA, "num_hidden_layers": 2, "n_routed_experts": 2, "num_experts_per_tok": 1}
        | {"moe_intermediate_size": 16, "first_k_dense_replace": 1},
        mla=True,
    ),
    "deepseek_v32": Case(
        "deepseek_v32",
        {**T, **MLA, "num_hidden_layers": 2, **DSA},
        mla=True,
    ),
    "glm_moe_dsa": Case(
        "glm_moe_dsa",
        {**T, **MLA, "num_hidden_layers": 2, **DSA},
        mla=True,
    ),
    "longcat_flash": Case(
        "longcat_flash",
        {**T, **MLA, "num_layers": 2, "head_dim": 8, "ffn_hidden_size": 64}
        | {"expert_ffn_hidden_size": 16, "n_routed_experts": 4, "zero_expert_num": 2}
        | {"moe_topk": 2},
        mla=True,
    ),
    # linear-attention hybrids
    "qwen3_next": Case(
        "qwen3_next",
        {**A, **GDN, **MOE, "shared_expert_intermediate_size": 16},
    ),
    "qwen3_5_text": Case("qwen3_5_text", {**A, **GDN}),
    "qwen3_5_moe_text": Case(
        "qwen3_5_moe_text", {**A, **GDN, **MOE, "shared_expert_intermediate_size": 16}
    ),
    "olmo_hybrid": Case("olmo_hybrid", {**T, **GDN, "num_hidden_layers": 4}),
    "olmo_hybrid/defaults": Case("olmo_hybrid", {**T, "num_hidden_layers": 3}),
    "minimax": Case(
        "minimax",
        {**A, "layer_types": ["linear_attention", "full_attention"] * 2}
        | {"num_local_experts": 2, "num_experts_per_tok": 1, "block_size": 4},
    ),
    "kimi_linear": Case(
        "kimi_linear",
        {**T, **MLA, "num_hidden_layers": 4, "q_lora_rank": None}
        | {"linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3]}}
        | {"num_experts": 2, "num_experts_per_token": 1, "moe_intermediate_size": 16}
        | {"linear_num_heads": 4, "linear_head_dim": 8},
        mla=True,
    ),
    "lfm2": Case("lfm2", {**T, "num_hidden_layers": 4, "full_attn_idxs": [1, 3]}),
    "lfm2/all_full": Case("lfm2", {**T, "num_hidden_layers": 2}),
    "lfm2_moe": Case(
        "lfm2_moe",
        {**T, **MOE, "num_hidden_layers": 4, "num_dense_layers": 1}
        | {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    ),
    # Mamba
    "mamba": Case("mamba", {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2}),
    "falcon_mamba": Case(
        "falcon_mamba", {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2}
    ),
    "mamba2": Case(
        "mamba2",
        {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 8}
        | {"head_dim": 8, "state_size": 8, "n_groups": 2, "chunk_size": 4},
    ),
    "jamba": Case(
        "jamba",
        {**T, "num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1}
        | {"expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 2}
        | {"num_experts_per_tok": 1, "mamba_d_state": 8, "mamba_dt_rank": 8}
        | {"use_mamba_kernels": False, "sliding_window": 8},  # read by neither
    ),
    "bamba": Case("bamba", {**T, **MAMBA2, "num_hidden_layers": 4, "attn_layer_indices": [1, 3]}),
    "granitemoehybrid": Case(
        "granitemoehybrid",
        {**T, **MAMBA2, "num_hidden_layers": 4}
        | {"layer_types": ["mamba", "mamba", "attention", "mamba"]}
        | {"num_local_experts": 2, "num_experts_per_tok": 1, "shared_intermediate_size": 32},
    ),
    "falcon_h1": Case(
        "falcon_h1",
        {**T, **MAMBA2, "num_hidden_layers": 3, "head_dim": 16, "mamba_d_ssm": 96}
        | {"mamba_d_head": 24},
    ),
    "nemotron_h": Case(
        "nemotron_h",
        {**T, "hybrid_override_pattern": "M-*EM", "head_dim": 16, "mamba_num_heads": 4}
        | {"mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 8, "conv_kernel": 4}
        | {"n_routed_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16}
        | {"moe_shared_expert_intermediate_size": 16, "chunk_size": 4},
    ),
    "zamba2": Case(
        "zamba2",
        {**T, "num_hidden_layers": 4, "layers_block_type": ["mamba", "hybrid"] * 2}
        | {"mamba_d_state": 8, "mamba_ngroups": 2, "n_mamba_heads": 4, "chunk_size": 4},
    ),
}


@pytest.fixture(autouse=True, scope="module")
def _quiet_transformers() -> None:
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # transformers imports its model machinery lazily: pay for that once, not in one case
    config = transformers.AutoConfig.for_model("llama", **{**A, "num_hidden_layers": 1})
    transformers.AutoModelForCausalLM.from_config(config)


def build_and_run(case: Case, tmp_path: Path) -> tuple[dict[str, Any], list[Row]]:
    """The config.json transformers writes for `case`, and the cache its model fills."""
    config = transformers.AutoConfig.for_model(case.model_type, **case.fields)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        out = model(input_ids=torch.randint(1, 100, (1, 5)), use_cache=True)
    cache = getattr(out, "past_key_values", None)
    if cache is None:
        cache = out.cache_params  # the Mamba models name it so
    num_layers = config.get_text_config().num_hidden_layers
    return saved, [hf_row(cache, i, case.mla) for i in range(num_layers)]


def hf_row(cache: Any, i: int, mla: bool) -> Row:
    """Layer i of a transformers cache, batch dim dropped, in the normal form of `hc_row`."""
    out: list[tuple[Any, ...]] = []
    linear = getattr(cache, "linear_cache", [])  # MiniMax keeps lightning state apart
    if i < len(linear) and isinstance(linear[i], torch.Tensor):
        out.append(("state", None, None, tuple(linear[i].shape[1:])))
    if i >= len(cache.layers):
        return tuple(out)  # a KV-sharing layer: transformers keeps no cache for it
    layer = cache.layers[i]
    keys = getattr(layer, "keys", None)
    if isinstance(keys, torch.Tensor) and keys.numel():
        k, v = tuple(keys.shape), tuple(layer.values.shape)
        window = getattr(layer, "sliding_window", None)
        if mla:
            index = getattr(layer, "indexer_keys", None)  # DSA's indexer key per token
            index_dim = index.shape[-1] if isinstance(index, torch.Tensor) else None
            out.append(("mla", k[-1] + v[-1], window, index_dim))
        else:
            out.append(("attn", k[1], k[-1], v[-1], window))
    convs = [t for t in (getattr(layer, "conv_states", None) or {}).values() if t is not None]
    recs = [t for t in (getattr(layer, "recurrent_states", None) or {}).values() if t is not None]
    if convs or recs:
        conv = (sum(t.shape[1] for t in convs), convs[0].shape[2] - 1) if convs else (None, None)
        rec = tuple(recs[0].shape[1:]) if recs else None
        out.append(("state", *conv, rec))
    return tuple(sorted(out, key=repr))


def hc_row(layout: ModelLayout, i: int) -> Row:
    out: list[tuple[Any, ...]] = []
    for c in layout.layers[i].caches:
        window = c.window_tokens or c.chunk_tokens
        if c.kv_format is KvFormat.MLA:
            out.append(("mla", c.head_dim, window, c.index.head_dim if c.index else None))
        elif c.kind.is_token_cache:
            out.append(("attn", c.num_kv_heads, c.head_dim, c.v_head_dim, window))
        else:
            shapes = dict(c.state_shapes)
            convs = [s for n, s in shapes.items() if n.startswith("conv")]
            rest = [s for n, s in shapes.items() if not n.startswith("conv")]
            assert len({s[1] for s in convs}) <= 1, shapes
            assert len(rest) <= 1, shapes
            conv = (sum(s[0] for s in convs), convs[0][1]) if convs else (None, None)
            out.append(("state", *conv, rest[0] if rest else None))
    return tuple(sorted(out, key=repr))


@pytest.mark.parametrize("name", sorted(CASES))
def test_layout_matches_the_cache_transformers_builds(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    saved, truth = build_and_run(case, tmp_path)
    hub_style = {"model_type": case.model_type, **case.fields}
    if case.generic:
        with pytest.raises(UnsupportedModelError, match=r"its field 'sliding_window' is 8 but"):
            layout_from_hf_config(hub_style)
        assert layout_from_hf_config(saved).rule.startswith("generic layer_types rule")
    for label, config in (("re-saved", saved), ("hub-style", hub_style))[
        : 1 if case.generic else 2
    ]:
        layout = layout_from_hf_config(config, f"{name} {label}")
        assert layout.num_layers == len(truth), label
        got = [hc_row(layout, i) for i in range(layout.num_layers)]
        assert got == truth, f"{label} config.json: hicache differs from transformers"


def test_the_cases_cover_every_family_transformers_ships() -> None:
    from hicache.model.families import supported_model_types

    shipped = {t for t in supported_model_types() if t in transformers.CONFIG_MAPPING}
    cased = {case.model_type for case in CASES.values()}
    # wrappers whose decoder is a cased *_text type
    elsewhere = {"gemma3", "gemma3n", "gemma4", "llama4", "qwen3_5", "qwen3_5_moe"}
    assert shipped - cased - elsewhere == set()


def test_resaved_configs_use_the_5x_spelling(tmp_path: Path) -> None:
    """The re-saved files really are in the new spelling, so the test above checks it."""
    saved, _ = build_and_run(CASES["nemotron_h"], tmp_path / "n")
    assert "num_hidden_layers" not in saved
    assert "hybrid_override_pattern" not in saved
    assert saved["layers_block_type"][:3] == ["linear_attention", "mlp", "full_attention"]
    saved, _ = build_and_run(CASES["kimi_linear"], tmp_path / "k")
    assert (saved["linear_num_heads"], saved["linear_head_dim"]) == (4, 8)
    assert saved["layer_types"] == ["linear_attention", "full_attention"] * 2
    saved, _ = build_and_run(CASES["gemma4_text/k_eq_v"], tmp_path / "g")
    assert "global_head_dim" not in saved
    assert saved["per_layer_config"] == {
        "2": {"head_dim": 32, "num_key_value_heads": 1},
        "5": {"head_dim": 32, "num_key_value_heads": 1},
    }
    layout = layout_from_hf_config(saved)
    full = layout.group("full").spec
    assert (full.kind, full.num_kv_heads, full.head_dim, full.v_head_dim) == (
        CacheKind.FULL,
        1,
        32,
        32,
    )


# transformers' layer type -> the cache kinds hicache must give that layer
_KINDS: dict[str, list[list[str]]] = {
    "full_attention": [["full"]],
    "sliding_attention": [["sliding"]],
    "chunked_attention": [["chunked"]],
    "indexed_attention": [["sparse"]],
    "linear_attention": [["linear"], ["mamba"]],
    "conv": [["conv"]],
    "hybrid": [["full", "mamba"]],
    "mlp": [[]],
    "moe": [[]],
}


@pytest.mark.parametrize("name", sorted(p.name for p in MODEL_CONFIGS.glob("*.json")))
def test_real_configs_agree_with_transformers_layer_types(name: str) -> None:
    """Each real config, loaded by transformers: its (derived) `layer_types` against hicache."""
    data = json.loads(shared_model(name).read_text())
    if data["model_type"] not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {data['model_type']!r}")
    fields = {k: v for k, v in data.items() if k != "model_type"}
    text = transformers.AutoConfig.for_model(data["model_type"], **fields).get_text_config()
    layout = layout_from_hf_config(data)
    types = getattr(text, "layer_types", None)
    if types is None:  # no list: the model reads `sliding_window` for every layer
        types = [
            "sliding_attention" if getattr(text, "sliding_window", None) else "full_attention"
        ] * len(layout.layers)
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    assert len(types) == layout.num_layers
    for i, kind in enumerate(types):
        got = [k.value for k in layout.layers[i].kinds]
        if i >= len(types) - shared:
            assert layout.layers[i].reuses is not None, i
        else:
            assert got in _KINDS[kind], f"layer {i}: transformers says {kind!r}, hicache {got}"
