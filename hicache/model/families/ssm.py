"""Rules for Mamba models: pure Mamba-1 (mamba, falcon_mamba) and Mamba-2 (mamba2), and the
hybrids Jamba (Mamba-1), Bamba, Granite-4 hybrid, Nemotron-H, Falcon-H1, Zamba2 (Mamba-2) and
Phi-4-mini-flash (SambaY: Mamba-1, sliding attention, YOCO sharing).

A Mamba layer keeps a per-request conv state (conv_dim x (d_conv - 1)) and SSM state;
Mamba-2's conv_dim is d_inner + 2 * n_groups * d_state and its SSM state is
(n_heads, head_dim, d_state). Mamba-1's is (d_inner, d_state). Layer lists use the hub's
names ('mamba', 'attention', 'M*-E' patterns) or transformers 5.x's ('linear_attention',
'full_attention', 'moe', 'mlp'); both are read.
"""

from __future__ import annotations

from hicache.model.families import family
from hicache.model.families.common import (
    Builder,
    ConfigView,
    attention,
    full,
    layers_from_types,
    mamba1,
    mamba2,
)
from hicache.model.specs import CacheKind, CacheSpec, LayerSpec

FULL, LINEAR = "full_attention", "linear_attention"


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


@family("mamba", "falcon_mamba")
def mamba(cfg: ConfigView) -> list[LayerSpec]:
    """Pure Mamba-1: every layer one state, d_inner = expand * hidden_size (defaults: expand 2,
    conv_kernel 4, state_size 16)."""
    cfg = cfg.with_defaults({"expand": 2, "conv_kernel": 4, "state_size": 16})
    d_inner = cfg.req_int("expand") * cfg.req_int("hidden_size")
    ssm = mamba1(d_inner, cfg.req_int("conv_kernel", minimum=2), cfg.req_int("state_size"))
    return [LayerSpec(i, (ssm,)) for i in range(cfg.num_layers)]


@family("mamba2")
def mamba2_only(cfg: ConfigView) -> list[LayerSpec]:
    """Pure Mamba-2: every layer one state; d_inner = expand * hidden_size (defaults: 128
    heads of 64, state_size 128, n_groups 8, expand 2, conv_kernel 4)."""
    cfg = cfg.with_defaults(
        {
            "num_heads": 128,
            "head_dim": 64,
            "state_size": 128,
            "n_groups": 8,
            "expand": 2,
            "conv_kernel": 4,
        }
    )
    ssm = mamba2(
        d_inner=cfg.req_int("expand") * cfg.req_int("hidden_size"),
        n_groups=cfg.req_int("n_groups"),
        d_state=cfg.req_int("state_size"),
        n_heads=cfg.req_int("num_heads"),
        head_dim=cfg.req_int("head_dim"),
        d_conv=cfg.req_int("conv_kernel", minimum=2),
    )
    return [LayerSpec(i, (ssm,)) for i in range(cfg.num_layers)]


@family("jamba")
def jamba(cfg: ConfigView) -> list[LayerSpec]:
    """Attention where i % attn_layer_period == attn_layer_offset (8 and 4 by default); every
    other layer Mamba-1 with d_inner = mamba_expand * hidden_size. The attention is always
    full: transformers' Jamba reads no `sliding_window` (older checkpoints set it to null)."""
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
    attn = full(cfg)
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
    """`layer_types` (or `layers_block_type`) of 'mamba' / 'attention', or their 5.x names;
    Mamba-2 layers. Without either list every layer is Mamba-2."""
    cfg = cfg.with_defaults(_MAMBA2_DEFAULTS)
    key = "layer_types" if cfg.has("layer_types") else "layers_block_type"
    types = cfg.layer_types(key) or [LINEAR] * cfg.num_layers
    d_inner = cfg.req_int("mamba_expand") * cfg.req_int("hidden_size")
    attn: Builder = lambda c: (full(c),)  # noqa: E731
    ssm: Builder = lambda c: (_mamba2_from(c, d_inner),)  # noqa: E731
    return layers_from_types(
        cfg, types, {"attention": attn, FULL: attn, "mamba": ssm, LINEAR: ssm}, key=key
    )


@family("falcon_h1")
def falcon_h1(cfg: ConfigView) -> list[LayerSpec]:
    """Every layer runs attention and Mamba-2 in parallel, so owns both caches. d_inner is
    `mamba_d_ssm`, or mamba_expand * hidden_size when that is unset."""
    cfg = cfg.with_defaults(_MAMBA2_DEFAULTS)
    d_inner = cfg.opt_int("mamba_d_ssm") or cfg.req_int("mamba_expand") * cfg.req_int("hidden_size")
    pair = (full(cfg), _mamba2_from(cfg, d_inner))
    return [LayerSpec(i, pair) for i in range(cfg.num_layers)]


_NEMOTRON_PATTERN = {"M": LINEAR, "*": FULL, "-": "mlp", "E": "moe"}


@family("nemotron_h")
def nemotron_h(cfg: ConfigView) -> list[LayerSpec]:
    """`layers_block_type` ('linear_attention' Mamba-2, 'full_attention', 'mlp', 'moe'; the
    last two own no cache), or the hub's `hybrid_override_pattern` with one character a
    layer (M, *, -, E). The list's length is the layer count. The hub's `mamba_n_groups` /
    `mamba_d_conv` win over `n_groups` / `conv_kernel`, as in transformers."""
    cfg = cfg.with_defaults({"head_dim": 128, "n_groups": 8, "conv_kernel": 4})
    key = "layers_block_type" if cfg.has("layers_block_type") else "layer_types"
    types = cfg.str_list(key)
    if types is None:
        key = "hybrid_override_pattern"
        pattern = cfg.get(key)
        if not isinstance(pattern, str) or not pattern:
            raise cfg.error(
                f"field 'hybrid_override_pattern' is {pattern!r} and there is no "
                "'layers_block_type' list; one of them must give each layer's type"
            )
        bad = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
        if bad:
            raise cfg.error(
                f"hybrid_override_pattern holds {bad[0]!r}; allowed: {sorted(_NEMOTRON_PATTERN)}"
            )
        types = [_NEMOTRON_PATTERN[ch] for ch in pattern]
    n_heads, head_dim = cfg.req_int("mamba_num_heads"), cfg.req_int("mamba_head_dim")
    n_groups_key = "mamba_n_groups" if cfg.has("mamba_n_groups") else "n_groups"
    conv_key = "mamba_d_conv" if cfg.has("mamba_d_conv") else "conv_kernel"
    ssm = mamba2(
        d_inner=n_heads * head_dim,
        n_groups=cfg.req_int(n_groups_key),
        d_state=cfg.req_int("ssm_state_size"),
        n_heads=n_heads,
        head_dim=head_dim,
        d_conv=cfg.req_int(conv_key, minimum=2),
    )
    none: Builder = lambda c: ()  # noqa: E731
    attn: Builder = lambda c: (full(c),)  # noqa: E731
    return layers_from_types(
        cfg,
        types,
        {LINEAR: lambda c: (ssm,), "mamba": lambda c: (ssm,), FULL: attn, "attention": attn}
        | {"mlp": none, "moe": none},
        key=key,
    )


@family("zamba2")
def zamba2(cfg: ConfigView) -> list[LayerSpec]:
    """`layers_block_type`: 'mamba' (5.x: 'linear_attention') layers own a Mamba-2 state;
    'hybrid' layers run the shared attention block (its own KV per layer) then Mamba-2.
    As in transformers, the Mamba head count is `n_mamba_heads` and its head dim
    d_inner / heads (a config with only `mamba_headdim` gives d_inner / mamba_headdim heads;
    with neither, 8 heads); the attention head dim is 2 * hidden_size / num_attention_heads."""
    cfg = cfg.with_defaults(
        {"mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1}
    )
    types = cfg.layer_types("layers_block_type")
    if types is None:
        hybrid_ids = set(cfg.int_list("hybrid_layer_ids") or [])
        types = ["hybrid" if i in hybrid_ids else LINEAR for i in range(cfg.num_layers)]
    hidden = cfg.req_int("hidden_size")
    d_inner = cfg.req_int("mamba_expand") * hidden
    head_dim = cfg.opt_int("mamba_headdim")
    if cfg.has("n_mamba_heads") or head_dim is None:
        n_heads = cfg.with_defaults({"n_mamba_heads": 8}).req_int("n_mamba_heads")
    else:
        n_heads = d_inner // head_dim
    if d_inner % n_heads or head_dim not in (None, d_inner // n_heads):
        raise cfg.error(
            f"n_mamba_heads {n_heads} and mamba_headdim {head_dim} do not split "
            f"mamba_expand * hidden_size = {d_inner}; allowed: heads x head dim = {d_inner}"
        )
    ssm = mamba2(
        d_inner=d_inner,
        n_groups=cfg.req_int("mamba_ngroups"),
        d_state=cfg.req_int("mamba_d_state"),
        n_heads=n_heads,
        head_dim=d_inner // n_heads,
        d_conv=cfg.req_int("mamba_d_conv", minimum=2),
    )
    attn = attention(cfg, CacheKind.FULL, head_dim=2 * hidden // cfg.num_heads)
    return layers_from_types(
        cfg,
        types,
        {"mamba": lambda c: (ssm,), LINEAR: lambda c: (ssm,), "hybrid": lambda c: (attn, ssm)},
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
