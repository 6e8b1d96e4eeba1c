"""Rules for linear-attention hybrids: Qwen3-Next, Qwen3.5 and OLMo-Hybrid (gated delta net),
MiniMax-M1 / Text-01 (lightning attention), Kimi Linear (KDA + MLA) and LFM2 / LFM2-MoE
(short conv + attention).

Linear layers keep a fixed-size per-request state, not per-token KV; its shapes come from
the config the way the serving engines size them (see `common` for the conv convention).
`layer_types` (transformers 5.x) is read first, then each family's older fields.
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
from hicache.model.specs import CacheKind, CacheSpec, LayerSpec, StateShard

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
        cfg, types, {FULL: lambda c: (full(c),), LINEAR: lambda c: (gated_delta_net(c),)}
    )


@family("olmo_hybrid")
def olmo_hybrid(cfg: ConfigView) -> list[LayerSpec]:
    """Gated delta net with every 4th layer full attention by default (the last layer when
    that leaves none). Linear heads default to `num_attention_heads`; the key head dim to
    int(0.75 * hidden_size / key heads) and the value head dim to twice that."""
    heads = cfg.num_heads
    k_heads = cfg.opt_int("linear_num_key_heads") or heads
    k_dim = cfg.opt_int("linear_key_head_dim") or int(0.75 * cfg.req_int("hidden_size") / k_heads)
    cfg = cfg.with_defaults(
        {
            "linear_num_key_heads": k_heads,
            "linear_num_value_heads": heads,
            "linear_key_head_dim": k_dim,
            "linear_value_head_dim": 2 * k_dim,
            "linear_conv_kernel_dim": 4,
        }
    )
    types = cfg.layer_types()
    if types is None:
        n = cfg.num_layers
        types = [FULL if i % 4 == 3 else LINEAR for i in range(n)]
        if FULL not in types:
            types[-1] = FULL
    return layers_from_types(
        cfg, types, {FULL: lambda c: (full(c),), LINEAR: lambda c: (gated_delta_net(c),)}
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

    def lightning(c: ConfigView) -> tuple[CacheSpec, ...]:
        heads = StateShard("heads", (("n_heads", c.num_heads),))  # vLLM: heads // tp
        return (
            state(CacheKind.LINEAR, ("kv", (c.num_heads, c.head_dim, c.head_dim)), shard=heads),
        )

    return layers_from_types(cfg, types, {FULL: lambda c: (full(c),), LINEAR: lightning})


def _kimi_types(cfg: ConfigView, block: dict[str, object] | None) -> list[str]:
    """Kimi Linear's layer list: `layer_types`, else `linear_attn_config`'s 1-based
    `full_attn_layers` / `kda_layers`, else every 4th layer from layer 4 full."""
    types = cfg.layer_types()
    if types is not None:
        return types
    n = cfg.num_layers
    if block is not None and "full_attn_layers" in block and "kda_layers" in block:
        sub = ConfigView(block, cfg.model_type, cfg.source + " linear_attn_config")
        full_1based = set(sub.int_list("full_attn_layers") or [])
        kda_1based = set(sub.int_list("kda_layers") or [])
        if full_1based & kda_1based or (full_1based | kda_1based) != set(range(1, n + 1)):
            raise cfg.error(
                "linear_attn_config.full_attn_layers and kda_layers must split the 1-based layer "
                f"numbers 1..{n} between them"
            )
        return [FULL if i + 1 in full_1based else LINEAR for i in range(n)]
    return [FULL if i and i % 4 == 0 else LINEAR for i in range(n)]


@family("kimi_linear")
def kimi_linear(cfg: ConfigView) -> list[LayerSpec]:
    """KDA layers keep short-conv states for q, k and v (kept apart, as SGLang does) plus a
    head_dim x head_dim state per head; full layers are MLA. Geometry from `linear_num_heads`
    / `linear_head_dim` / `linear_conv_kernel_dim` (32 / 128 / 4), or from the checkpoint's
    `linear_attn_config` (`num_heads`, `head_dim`, `short_conv_kernel_size`)."""
    block = cfg.get("linear_attn_config")
    if block is not None and not isinstance(block, dict):
        raise cfg.error(f"field 'linear_attn_config' is {block!r}; a mapping is required")
    # As in transformers, the checkpoint's block wins over the top-level fields.
    legacy = {
        "linear_num_heads": "num_heads",
        "linear_head_dim": "head_dim",
        "linear_conv_kernel_dim": "short_conv_kernel_size",
    }
    given = block or {}
    from_block = {key: given[old] for key, old in legacy.items() if given.get(old) is not None}
    cfg = ConfigView({**cfg.data, **from_block}, cfg.model_type, cfg.source).with_defaults(
        {
            "linear_num_heads": 32,
            "linear_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
        }
    )
    types = _kimi_types(cfg, block)
    heads, dim = cfg.req_int("linear_num_heads"), cfg.req_int("linear_head_dim")
    kernel = cfg.req_int("linear_conv_kernel_dim")
    kda = state(
        CacheKind.LINEAR,
        ("conv_q", (heads * dim, kernel - 1)),
        ("conv_k", (heads * dim, kernel - 1)),
        ("conv_v", (heads * dim, kernel - 1)),
        ("recurrent", (heads, dim, dim)),
    )
    return layers_from_types(cfg, types, {FULL: lambda c: (mla(c),), LINEAR: lambda c: (kda,)})


@family("lfm2", "lfm2_moe")
def lfm2(cfg: ConfigView) -> list[LayerSpec]:
    """`layer_types` ('conv' / 'full_attention'), or LFM2's `full_attn_idxs` (absent: every
    layer full attention). A conv layer's short conv has kernel `conv_L_cache` over
    hidden_size channels and keeps the last conv_L_cache - 1 inputs."""
    cfg = cfg.with_defaults({"conv_L_cache": 3})
    types = cfg.layer_types()
    if types is None:
        if cfg.model_type == "lfm2_moe":
            raise cfg.error(
                "field 'layer_types' is missing; LFM2-MoE names each layer's type there"
            )
        n = cfg.num_layers
        idxs = cfg.int_list("full_attn_idxs")
        attn = set(range(n)) if idxs is None else set(idxs)
        types = [FULL if i in attn else "conv" for i in range(n)]
    kernel = cfg.req_int("conv_L_cache", minimum=2)
    conv = state(CacheKind.CONV, ("conv", (cfg.req_int("hidden_size"), kernel - 1)))
    return layers_from_types(cfg, types, {FULL: lambda c: (full(c),), "conv": lambda c: (conv,)})
