"""Rules for linear-attention hybrids: Qwen3-Next and Qwen3.5 (gated delta net), MiniMax-M1 /
Text-01 (lightning attention), Kimi Linear (KDA + MLA) and LFM2 (short conv + attention).

Linear layers keep a fixed-size per-request state, not per-token KV; its shapes come from
the config the way the model's cache code sizes them.
"""

from __future__ import annotations

from hicache.model.families import family
from hicache.model.families.common import (
    ConfigView,
    every_nth,
    full,
    gated_delta_net,
    layers_from_types,
    mla,
    state,
)
from hicache.model.specs import CacheKind, LayerSpec

FULL, LINEAR = "full_attention", "linear_attention"


@family("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
def qwen3_next(cfg: ConfigView) -> list[LayerSpec]:
    """Every `full_attention_interval`-th layer (default 4) full; the rest gated delta net."""
    cfg = cfg.with_defaults(
        {
            "head_dim": 256,
            "full_attention_interval": 4,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
        }
    )
    types = cfg.layer_types() or every_nth(
        cfg.num_layers, cfg.req_int("full_attention_interval"), FULL, LINEAR
    )
    return layers_from_types(
        cfg, types, {FULL: lambda: (full(cfg),), LINEAR: lambda: (gated_delta_net(cfg),)}
    )


@family("minimax", "minimax_m1", "minimax_text_01")
def minimax(cfg: ConfigView) -> list[LayerSpec]:
    """`attn_type_list[i]` is 1 for softmax (full) attention, 0 for lightning attention, whose
    state is one head_dim x head_dim matrix per attention head."""
    types = cfg.layer_types()
    if types is None:
        flags = cfg.int_list("attn_type_list")
        if flags is None:
            raise cfg.error(
                "neither 'layer_types' nor 'attn_type_list' is set; one of them must say which "
                "layers are softmax (1) and which lightning attention (0)"
            )
        cfg.per_layer("attn_type_list", cfg.num_layers, flags)
        bad = [f for f in flags if f not in (0, 1)]
        if bad:
            raise cfg.error(f"attn_type_list holds {bad[0]!r}; allowed: 0 (linear) or 1 (full)")
        types = [FULL if f == 1 else LINEAR for f in flags]
    heads, dim = cfg.num_heads, cfg.head_dim
    return layers_from_types(
        cfg,
        types,
        {
            FULL: lambda: (full(cfg),),
            LINEAR: lambda: (state(CacheKind.LINEAR, ("kv", (heads, dim, dim))),),
        },
    )


@family("kimi_linear")
def kimi_linear(cfg: ConfigView) -> list[LayerSpec]:
    """`linear_attn_config` lists KDA and full (MLA) layers with 1-based numbers. A KDA layer
    keeps short-conv states for q, k and v plus a head_dim x head_dim state per head."""
    block = cfg.get("linear_attn_config")
    if not isinstance(block, dict):
        raise cfg.error(f"field 'linear_attn_config' is {block!r}; a mapping is required")
    sub = ConfigView(block, cfg.model_type, cfg.source + " linear_attn_config")
    full_1based = set(sub.int_list("full_attn_layers") or [])
    kda_1based = set(sub.int_list("kda_layers") or [])
    n = cfg.num_layers
    if full_1based & kda_1based or (full_1based | kda_1based) - set(range(1, n + 1)):
        raise cfg.error(
            "linear_attn_config.full_attn_layers and kda_layers must be disjoint 1-based layer "
            f"numbers in 1..{n}"
        )
    heads, dim = sub.req_int("num_heads"), sub.req_int("head_dim")
    kernel = sub.req_int("short_conv_kernel_size")
    kda = state(
        CacheKind.LINEAR,
        ("conv_q", (heads * dim, kernel - 1)),
        ("conv_k", (heads * dim, kernel - 1)),
        ("conv_v", (heads * dim, kernel - 1)),
        ("recurrent", (heads, dim, dim)),
    )
    attn = mla(cfg.with_defaults({"qk_rope_head_dim": 64}))
    return [
        LayerSpec(i, (attn,) if i + 1 in full_1based else (kda,) if i + 1 in kda_1based else ())
        for i in range(n)
    ]


@family("lfm2", "lfm2_moe")
def lfm2(cfg: ConfigView) -> list[LayerSpec]:
    """`layer_types` ('conv' / 'full_attention'), or `full_attn_idxs`; a conv layer keeps a
    (hidden_size x conv_L_cache) state."""
    cfg = cfg.with_defaults({"conv_L_cache": 3})
    types = cfg.layer_types()
    if types is None:
        idxs = set(cfg.int_list("full_attn_idxs") or [])
        types = [FULL if i in idxs else "conv" for i in range(cfg.num_layers)]
    conv = state(
        CacheKind.CONV, ("conv", (cfg.req_int("hidden_size"), cfg.req_int("conv_L_cache")))
    )
    return layers_from_types(cfg, types, {FULL: lambda: (full(cfg),), "conv": lambda: (conv,)})
