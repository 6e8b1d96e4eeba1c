"""Rules for softmax-attention families: full, sliding-window, chunked and KV-sharing layers.

Every rule reads `layer_types` first (what transformers 5.x writes on every re-save) and
falls back to the family's own pattern fields and defaults, as its transformers config does.
Per-layer geometry (`per_layer_config`, Gemma 4's global heads, MiMo-V2's SWA heads) is read
per layer, so sliding and full layers may differ in KV heads and K / V head dims.

llama, glm/glm4 (+moe), granite (+moe), olmo2, apertus, seed_oss, ernie4_5 (+moe), phi3,
mistral, ministral, qwen2/qwen3 (+moe), smollm3, mimo, mimo_v2_flash, gemma2, gemma3, gemma3n,
gemma4, cohere2, gpt_oss, llama4, exaone4, olmo3, minimax_m2.
"""

from __future__ import annotations

from hicache.model.families import family
from hicache.model.families.common import (
    Builder,
    ConfigView,
    attention,
    chunked,
    every_nth,
    full,
    layers_from_types,
    sliding,
)
from hicache.model.specs import CacheKind, CacheSpec, LayerSpec

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"

_FULL_OR_SLIDING: dict[str, Builder] = {
    FULL: lambda c: (full(c),),
    SLIDING: lambda c: (sliding(c),),
}


def _full_or_sliding(cfg: ConfigView, types: list[str]) -> list[LayerSpec]:
    return layers_from_types(cfg, types, _FULL_OR_SLIDING)


@family(
    "llama",
    "glm",
    "glm4",
    "glm4_moe",
    "granite",
    "granitemoe",
    "olmo2",
    "apertus",
    "seed_oss",
    "ernie4_5",
    "ernie4_5_moe",
)
def all_full(cfg: ConfigView) -> list[LayerSpec]:
    """Every layer full attention; these models read no sliding field."""
    return _full_or_sliding(cfg, cfg.layer_types() or [FULL] * cfg.num_layers)


@family("mistral", "ministral", "phi3")
def sliding_everywhere(cfg: ConfigView) -> list[LayerSpec]:
    """`sliding_window` applies to every layer; null means full attention. Mistral defaults
    the window to 4096 (and 8 KV heads), Phi-3 to none."""
    if cfg.model_type in ("mistral", "ministral"):
        cfg = cfg.with_defaults({"sliding_window": 4096, "num_key_value_heads": 8})
    types = cfg.layer_types()
    if types is None:
        types = [SLIDING if cfg.get("sliding_window") is not None else FULL] * cfg.num_layers
    return _full_or_sliding(cfg, types)


def _window_enabled(cfg: ConfigView) -> bool:
    return bool(cfg.get("use_sliding_window")) and bool(cfg.get("sliding_window"))


@family("qwen2", "qwen3", "mimo")
def qwen(cfg: ConfigView) -> list[LayerSpec]:
    """Sliding only when `use_sliding_window`, and then only for layers >= max_window_layers."""
    cfg = cfg.with_defaults({"use_sliding_window": False, "max_window_layers": 28})
    types = cfg.layer_types()
    if types is None:
        use = _window_enabled(cfg)
        first = cfg.req_int("max_window_layers", minimum=0)
        types = [SLIDING if use and i >= first else FULL for i in range(cfg.num_layers)]
    return _full_or_sliding(cfg, types)


@family("qwen2_moe")
def qwen2_moe(cfg: ConfigView) -> list[LayerSpec]:
    """With `use_sliding_window`, even layers below `max_window_layers` (28) slide."""
    cfg = cfg.with_defaults({"use_sliding_window": False, "max_window_layers": 28})
    types = cfg.layer_types()
    if types is None:
        use = _window_enabled(cfg)
        last = cfg.req_int("max_window_layers", minimum=0)
        types = [
            SLIDING if use and i % 2 == 0 and i < last else FULL for i in range(cfg.num_layers)
        ]
    return _full_or_sliding(cfg, types)


@family("qwen3_moe")
def qwen3_moe(cfg: ConfigView) -> list[LayerSpec]:
    """With `use_sliding_window`, every layer slides (no max_window_layers)."""
    types = cfg.layer_types()
    if types is None:
        types = [SLIDING if _window_enabled(cfg) else FULL] * cfg.num_layers
    return _full_or_sliding(cfg, types)


@family("smollm3")
def smollm3(cfg: ConfigView) -> list[LayerSpec]:
    """With `use_sliding_window`, the NoPE layers (`no_rope_layers[i] == 0`; by default every
    `no_rope_layer_interval`-th, 4) slide; RoPE layers stay full."""
    cfg = cfg.with_defaults({"no_rope_layer_interval": 4})
    types = cfg.layer_types()
    if types is None:
        n = cfg.num_layers
        has_rope = cfg.int_list("no_rope_layers")
        if has_rope is None:
            has_rope = every_nth(n, cfg.req_int("no_rope_layer_interval"), 0, 1)
        cfg.per_layer("no_rope_layers", n, has_rope)
        use = _window_enabled(cfg)
        types = [SLIDING if use and not rope else FULL for rope in has_rope]
    return _full_or_sliding(cfg, types)


@family("gemma2")
def gemma2(cfg: ConfigView) -> list[LayerSpec]:
    """Alternating: even layers sliding (window 4096 by default), odd layers full."""
    cfg = cfg.with_defaults({"head_dim": 256, "sliding_window": 4096, "num_key_value_heads": 4})
    return _full_or_sliding(cfg, cfg.layer_types() or every_nth(cfg.num_layers, 2, FULL, SLIDING))


@family("gemma3", "gemma3_text")
def gemma3(cfg: ConfigView) -> list[LayerSpec]:
    """Every `sliding_window_pattern`-th layer (default 6) is full; the rest slide (4096)."""
    cfg = cfg.with_defaults(
        {
            "head_dim": 256,
            "sliding_window": 4096,
            "num_key_value_heads": 4,
            "sliding_window_pattern": 6,
        }
    )
    types = cfg.layer_types() or every_nth(
        cfg.num_layers, cfg.req_int("sliding_window_pattern"), FULL, SLIDING
    )
    return _full_or_sliding(cfg, types)


@family("cohere2")
def cohere2(cfg: ConfigView) -> list[LayerSpec]:
    """Every `sliding_window_pattern`-th layer (default 4) is full; the rest slide (4096)."""
    cfg = cfg.with_defaults({"sliding_window": 4096, "sliding_window_pattern": 4})
    types = cfg.layer_types() or every_nth(
        cfg.num_layers, cfg.req_int("sliding_window_pattern"), FULL, SLIDING
    )
    return _full_or_sliding(cfg, types)


@family("olmo3")
def olmo3(cfg: ConfigView) -> list[LayerSpec]:
    """Every 4th layer full, the rest sliding (window 4096 by default)."""
    cfg = cfg.with_defaults({"sliding_window": 4096})
    return _full_or_sliding(cfg, cfg.layer_types() or every_nth(cfg.num_layers, 4, FULL, SLIDING))


@family("gpt_oss")
def gpt_oss(cfg: ConfigView) -> list[LayerSpec]:
    """Alternating sliding (window 128) and full, starting with sliding."""
    cfg = cfg.with_defaults({"head_dim": 64, "sliding_window": 128, "num_key_value_heads": 8})
    return _full_or_sliding(cfg, cfg.layer_types() or every_nth(cfg.num_layers, 2, FULL, SLIDING))


@family("exaone4")
def exaone4(cfg: ConfigView) -> list[LayerSpec]:
    """`sliding_window_pattern` is an int n (every n-th layer full) or a string like 'LLLG'
    repeated over the layers (L local/sliding, G global/full). No sliding_window: all full."""
    cfg = cfg.with_defaults({"sliding_window": 4096, "sliding_window_pattern": 4})
    types = cfg.layer_types()
    if types is None:
        n, pattern = cfg.num_layers, cfg.get("sliding_window_pattern")
        if cfg.get("sliding_window") is None:
            types = [FULL] * n
        elif isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
            types = [SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(n)]
        elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
            types = every_nth(n, pattern, FULL, SLIDING)
        else:
            raise cfg.error(
                f"field 'sliding_window_pattern' is {pattern!r}; allowed: a positive integer "
                "or a string of 'L' and 'G' such as 'LLLG'"
            )
    return _full_or_sliding(cfg, types)


@family("llama4", "llama4_text")
def llama4(cfg: ConfigView) -> list[LayerSpec]:
    """RoPE layers use chunked attention (`attention_chunk_size`); every
    `no_rope_layer_interval`-th layer (default 4) is a NoPE layer with full attention.
    `no_rope_layers[i]` is 1 for a RoPE (chunked) layer; an empty list means the default."""
    cfg = cfg.with_defaults(
        {
            "head_dim": 128,
            "num_key_value_heads": 8,
            "attention_chunk_size": 8192,
            "no_rope_layer_interval": 4,
        }
    )
    n = cfg.num_layers
    types = cfg.layer_types()
    if types is None:
        use_rope = cfg.int_list("no_rope_layers") or every_nth(
            n, cfg.req_int("no_rope_layer_interval"), 0, 1
        )
        cfg.per_layer("no_rope_layers", n, use_rope)
        is_chunked = cfg.get("attention_chunk_size") is not None
        types = [CHUNKED if rope and is_chunked else FULL for rope in use_rope]
    return layers_from_types(
        cfg, types, {FULL: lambda c: (full(c),), CHUNKED: lambda c: (chunked(c),)}
    )


@family("minimax_m2")
def minimax_m2(cfg: ConfigView) -> list[LayerSpec]:
    """MiniMax-M2 dropped lightning attention: every layer is full softmax attention
    (an `attn_type_list`, when present, must then be all 1)."""
    types = cfg.int_list("attn_type_list")
    if types is not None and any(t != 1 for t in types):
        raise cfg.error(
            f"attn_type_list {types!r} has linear layers (0); minimax_m2 allows only 1 (full); "
            "use model_type 'minimax' for hybrid lightning-attention checkpoints"
        )
    return _full_or_sliding(cfg, [FULL] * cfg.num_layers)


@family("mimo_v2_flash")
def mimo_v2_flash(cfg: ConfigView) -> list[LayerSpec]:
    """MiMo-V2-Flash: K is `head_dim` (192) wide, V `v_head_dim` (128). Full attention on
    layer 0 and every 6th layer, sliding (`sliding_window`, 128) elsewhere, or as
    `hybrid_layer_pattern` says (1 sliding, 0 full). Sliding layers have their own
    `swa_num_key_value_heads` (default: twice the full layers'), `swa_head_dim` and
    `swa_v_head_dim` (default: the full layers')."""
    cfg = cfg.with_defaults({"head_dim": 192, "v_head_dim": 128})
    n = cfg.num_layers
    types = cfg.layer_types()
    if types is None:
        flags = cfg.int_list("hybrid_layer_pattern")
        if flags is None:
            types = [FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(n)]
        else:
            cfg.per_layer("hybrid_layer_pattern", n, flags)
            bad = [f for f in flags if f not in (0, 1)]
            if bad:
                raise cfg.error(
                    f"hybrid_layer_pattern holds {bad[0]!r}; allowed: 1 (sliding) or 0 (full)"
                )
            types = [SLIDING if f == 1 else FULL for f in flags]
    window_key = "sliding_window" if cfg.has("sliding_window") else "sliding_window_size"
    cfg = cfg.with_defaults({window_key: 128})

    def full_layer(c: ConfigView) -> tuple[CacheSpec, ...]:
        return (
            attention(c, CacheKind.FULL, head_dim=c.head_dim, v_head_dim=c.req_int("v_head_dim")),
        )

    def swa_layer(c: ConfigView) -> tuple[CacheSpec, ...]:
        k_dim = c.opt_int("swa_head_dim") or c.head_dim
        return (
            attention(
                c,
                CacheKind.SLIDING,
                window=c.req_int(window_key),
                kv_heads=c.opt_int("swa_num_key_value_heads") or 2 * c.kv_heads,
                head_dim=k_dim,
                v_head_dim=c.opt_int("swa_v_head_dim") or c.req_int("v_head_dim"),
            ),
        )

    return layers_from_types(cfg, types, {FULL: full_layer, SLIDING: swa_layer})


def _kv_shared(cfg: ConfigView, types: list[str], layers: list[LayerSpec]) -> list[LayerSpec]:
    """Gemma 3n / 4 KV sharing: the last `num_kv_shared_layers` layers own no KV and read the
    KV of the last earlier, non-shared layer of the same attention type."""
    shared = cfg.req_int("num_kv_shared_layers", minimum=0)
    first_shared = len(types) - shared
    if shared == 0:
        return layers
    if first_shared <= 0:
        raise cfg.error(
            f"num_kv_shared_layers is {shared} with {len(types)} layers; "
            f"allowed: 0..{len(types) - 1}"
        )
    out = list(layers[:first_shared])
    prefix = types[:first_shared]
    for layer_id in range(first_shared, len(types)):
        kind = types[layer_id]
        if kind not in prefix:
            raise cfg.error(
                f"layer {layer_id} is a KV-sharing {kind} layer but no earlier layer has that type"
            )
        source = len(prefix) - 1 - prefix[::-1].index(kind)
        out.append(LayerSpec(layer_id, (), reuses=source))
    return out


@family("gemma3n", "gemma3n_text")
def gemma3n(cfg: ConfigView) -> list[LayerSpec]:
    """Every 5th layer full, the rest sliding (window 512); the last 15 layers share KV."""
    cfg = cfg.with_defaults(
        {
            "head_dim": 256,
            "sliding_window": 512,
            "num_key_value_heads": 2,
            "num_kv_shared_layers": 15,
        }
    )
    types = cfg.layer_types() or every_nth(cfg.num_layers, 5, FULL, SLIDING)
    return _kv_shared(cfg, types, _full_or_sliding(cfg, types))


@family("gemma4", "gemma4_text")
def gemma4(cfg: ConfigView) -> list[LayerSpec]:
    """Sliding layers use `num_key_value_heads` x `head_dim`. Full layers use `global_head_dim`
    (512) and, when `attention_k_eq_v`, `num_global_key_value_heads`; a config re-saved by
    transformers 5.x carries these as `per_layer_config` overrides instead. With
    `attention_k_eq_v` the V projection is the K projection, but the cached V (normed, no
    RoPE) still differs from the cached K, so both are kept. Every 6th layer is full by
    default and the last layer always is; tail layers may share KV."""
    cfg = cfg.with_defaults(
        {
            "head_dim": 256,
            "global_head_dim": 512,
            "sliding_window": 512,
            "num_kv_shared_layers": 0,
            "attention_k_eq_v": False,
        }
    )
    types = list(cfg.layer_types() or every_nth(cfg.num_layers, 6, FULL, SLIDING))
    types[-1] = FULL
    if cfg.get("per_layer_config") is None:
        overrides: dict[str, int] = {"head_dim": cfg.req_int("global_head_dim")}
        if cfg.get("attention_k_eq_v") is True:
            global_heads = cfg.opt_int("num_global_key_value_heads")
            if global_heads is not None:
                overrides["num_key_value_heads"] = global_heads
        cfg = cfg.with_layer_overrides(
            {i: overrides for i, kind in enumerate(types) if kind == FULL}
        )
    return _kv_shared(cfg, types, _full_or_sliding(cfg, types))
