"""Rules for Mamba hybrids: Jamba (Mamba-1), Bamba, Granite-4 hybrid, Nemotron-H, Falcon-H1,
Zamba2 (Mamba-2) and Phi-4-mini-flash (SambaY: Mamba-1, sliding attention, YOCO sharing).

A Mamba layer keeps a per-request conv state (conv_dim x (d_conv - 1)) and SSM state;
Mamba-2's conv_dim is d_inner + 2 * n_groups * d_state and its SSM state is
(n_heads, head_dim, d_state). Mamba-1's is (d_inner, d_state).
"""

from __future__ import annotations

from hicache.model.families import family
from hicache.model.families.common import (
    ConfigView,
    attention,
    full,
    layers_from_types,
    mamba1,
    mamba2,
)
from hicache.model.specs import CacheKind, CacheSpec, LayerSpec


def _mamba2_from(cfg: ConfigView, d_inner: int) -> CacheSpec:
    """Bamba / Granite hybrid / Falcon-H1 field names (`mamba_*`); d_head 'auto' means
    d_inner / n_heads."""
    n_heads = cfg.req_int("mamba_n_heads")
    d_head = cfg.get("mamba_d_head")
    head_dim = d_inner // n_heads if d_head in (None, "auto") else cfg.req_int("mamba_d_head")
    return mamba2(
        d_inner=d_inner,
        n_groups=cfg.req_int("mamba_n_groups"),
        d_state=cfg.req_int("mamba_d_state"),
        n_heads=n_heads,
        head_dim=head_dim,
        d_conv=cfg.req_int("mamba_d_conv"),
    )


_MAMBA2_DEFAULTS = {
    "mamba_n_heads": 128,
    "mamba_d_head": "auto",
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}


@family("jamba")
def jamba(cfg: ConfigView) -> list[LayerSpec]:
    """Attention where i % attn_layer_period == attn_layer_offset (8 and 4 by default); every
    other layer Mamba-1 with d_inner = mamba_expand * hidden_size."""
    cfg = cfg.with_defaults(
        {
            "attn_layer_period": 8,
            "attn_layer_offset": 4,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "num_key_value_heads": 8,
        }
    )
    period, offset = cfg.req_int("attn_layer_period"), cfg.req_int("attn_layer_offset", minimum=0)
    d_inner = cfg.req_int("mamba_expand") * cfg.req_int("hidden_size")
    window = cfg.opt_int("sliding_window")
    attn = attention(cfg, CacheKind.SLIDING, window=window) if window else full(cfg)
    ssm = mamba1(d_inner, cfg.req_int("mamba_d_conv"), cfg.req_int("mamba_d_state"))
    return [
        LayerSpec(i, (attn,) if i % period == offset else (ssm,)) for i in range(cfg.num_layers)
    ]


@family("bamba")
def bamba(cfg: ConfigView) -> list[LayerSpec]:
    """Attention at `attn_layer_indices`; every other layer Mamba-2."""
    cfg = cfg.with_defaults(_MAMBA2_DEFAULTS)
    attn_ids = set(cfg.int_list("attn_layer_indices") or [])
    ssm = _mamba2_from(cfg, cfg.req_int("mamba_expand") * cfg.req_int("hidden_size"))
    attn = full(cfg)
    return [LayerSpec(i, (attn,) if i in attn_ids else (ssm,)) for i in range(cfg.num_layers)]


@family("granitemoehybrid")
def granite_hybrid(cfg: ConfigView) -> list[LayerSpec]:
    """`layer_types` (or `layers_block_type`) of 'mamba' / 'attention'; Mamba-2 layers."""
    cfg = cfg.with_defaults(_MAMBA2_DEFAULTS)
    types = cfg.str_list("layer_types") or cfg.str_list("layers_block_type")
    if types is None:
        raise cfg.error("neither 'layer_types' nor 'layers_block_type' is set")
    cfg.per_layer("layer_types", cfg.num_layers, types)
    d_inner = cfg.req_int("mamba_expand") * cfg.req_int("hidden_size")
    return layers_from_types(
        cfg,
        types,
        {"attention": lambda: (full(cfg),), "mamba": lambda: (_mamba2_from(cfg, d_inner),)},
    )


@family("falcon_h1")
def falcon_h1(cfg: ConfigView) -> list[LayerSpec]:
    """Every layer runs attention and Mamba-2 in parallel, so owns both caches. d_inner is
    `mamba_d_ssm`, or mamba_expand * hidden_size when that is unset."""
    cfg = cfg.with_defaults(_MAMBA2_DEFAULTS)
    d_inner = cfg.opt_int("mamba_d_ssm") or cfg.req_int("mamba_expand") * cfg.req_int("hidden_size")
    pair = (full(cfg), _mamba2_from(cfg, d_inner))
    return [LayerSpec(i, pair) for i in range(cfg.num_layers)]


@family("nemotron_h")
def nemotron_h(cfg: ConfigView) -> list[LayerSpec]:
    """`hybrid_override_pattern`, one character a layer: M Mamba-2, * attention, - MLP,
    E MoE (the last two own no cache)."""
    cfg = cfg.with_defaults({"head_dim": 128, "n_groups": 8, "conv_kernel": 4})
    pattern = cfg.get("hybrid_override_pattern")
    if not isinstance(pattern, str):
        raise cfg.error(f"field 'hybrid_override_pattern' is {pattern!r}; a string is required")
    cfg.per_layer("hybrid_override_pattern", cfg.num_layers, pattern)
    n_heads, head_dim = cfg.req_int("mamba_num_heads"), cfg.req_int("mamba_head_dim")
    ssm = mamba2(
        d_inner=n_heads * head_dim,
        n_groups=cfg.req_int("n_groups"),
        d_state=cfg.req_int("ssm_state_size"),
        n_heads=n_heads,
        head_dim=head_dim,
        d_conv=cfg.req_int("conv_kernel"),
    )
    return layers_from_types(
        cfg,
        list(pattern),
        {"M": lambda: (ssm,), "*": lambda: (full(cfg),), "-": lambda: (), "E": lambda: ()},
        key="hybrid_override_pattern",
    )


@family("zamba2")
def zamba2(cfg: ConfigView) -> list[LayerSpec]:
    """`layers_block_type`: 'mamba' layers own a Mamba-2 state; 'hybrid' layers run the shared
    attention block (its own KV per layer; head_dim = 2 * hidden_size / heads) then Mamba-2."""
    cfg = cfg.with_defaults(
        {
            "mamba_d_state": 64,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_ngroups": 1,
            "mamba_headdim": 64,
        }
    )
    types = cfg.str_list("layers_block_type")
    if types is None:
        hybrid_ids = set(cfg.int_list("hybrid_layer_ids") or [])
        types = ["hybrid" if i in hybrid_ids else "mamba" for i in range(cfg.num_layers)]
    cfg.per_layer("layers_block_type", cfg.num_layers, types)
    hidden = cfg.req_int("hidden_size")
    d_inner = cfg.req_int("mamba_expand") * hidden
    head_dim = cfg.req_int("mamba_headdim")
    ssm = mamba2(
        d_inner=d_inner,
        n_groups=cfg.req_int("mamba_ngroups"),
        d_state=cfg.req_int("mamba_d_state"),
        n_heads=d_inner // head_dim,
        head_dim=head_dim,
        d_conv=cfg.req_int("mamba_d_conv"),
    )
    attn_dim = cfg.opt_int("attention_head_dim") or 2 * hidden // cfg.num_heads
    attn = attention(cfg, CacheKind.FULL, head_dim=attn_dim)
    return layers_from_types(
        cfg,
        types,
        {"mamba": lambda: (ssm,), "hybrid": lambda: (attn, ssm)},
        key="layers_block_type",
    )


@family("phi4flash")
def phi4flash(cfg: ConfigView) -> list[LayerSpec]:
    """SambaY: even layers Mamba-1, odd layers attention. In the first half, attention slides
    (`sliding_window`); layer L/2 + 1 is full attention and its KV is read by every later odd
    layer (YOCO cross-attention); even layers after L/2 are gated memory units with no cache."""
    cfg = cfg.with_defaults(
        {
            "sliding_window": 2047,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "num_key_value_heads": 4,
        }
    )
    n = cfg.num_layers
    half = n // 2
    d_inner = cfg.req_int("mamba_expand") * cfg.req_int("hidden_size")
    ssm = mamba1(d_inner, cfg.req_int("mamba_d_conv"), cfg.req_int("mamba_d_state"))
    slide = attention(cfg, CacheKind.SLIDING, window=cfg.req_int("sliding_window"))
    # The model's predicates: yoco_cross = i >= half + 2. Cross layers own no cache.
    odd_below_cross = [i for i in range(1, min(n, half + 2), 2) if i >= half]
    if not odd_below_cross:
        raise cfg.error(f"num_hidden_layers {n} leaves no full-attention YOCO KV layer; use >= 4")
    kv_source = odd_below_cross[-1]
    layers = []
    for i in range(n):
        if i % 2 == 0:
            layers.append(LayerSpec(i, (ssm,) if i < half + 2 else ()))
        elif i < half:
            layers.append(LayerSpec(i, (slide,)))
        elif i < half + 2:
            layers.append(LayerSpec(i, (full(cfg),)))
        else:
            layers.append(LayerSpec(i, (), reuses=kv_source))
    return layers
