"""The generic rule for a `model_type` no family knows.

It reads only what every decoder config spells the same way: `num_hidden_layers` (or the
length of `layer_types`), `hidden_size`, `num_attention_heads`, `num_key_value_heads`,
`head_dim`, and `layer_types` made of full / sliding / chunked attention (with
`sliding_window` / `attention_chunk_size`), plus `per_layer_config` overrides. Without
`layer_types`, every layer is dense full attention (or sliding, when `use_sliding_window`
says so). A config whose fields suggest anything else (Mamba or linear-attention state,
MLA latents, KV sharing, a sliding pattern the rule cannot place) is refused with the field
named, never guessed: a wrong layout would silently corrupt the cache.
"""

from __future__ import annotations

from hicache.errors import UnsupportedModelError
from hicache.model.families import supported_model_types
from hicache.model.families.common import (
    Builder,
    ConfigView,
    chunked,
    full,
    layers_from_types,
    sliding,
)
from hicache.model.specs import LayerSpec

EXPLICIT_EXAMPLE = """\
model:
  model_type: my-model
  layers:
    - {repeat: 3, kind: sliding, kv_heads: 8, head_dim: 128, window_tokens: 1024}
    - {kind: full, kv_heads: 8, head_dim: 128}"""

_TYPES: dict[str, Builder] = {
    "full_attention": lambda c: (full(c),),
    "sliding_attention": lambda c: (sliding(c),),
    "chunked_attention": lambda c: (chunked(c),),
}
READS = (
    "it reads hidden_size, num_attention_heads, num_key_value_heads, head_dim, "
    "num_hidden_layers and layer_types of " + " / ".join(sorted(_TYPES))
)

# Fields that say a layer keeps something the generic rule cannot size, by name or prefix.
_HYBRID_FIELDS = (
    "layers_block_type",
    "hybrid_override_pattern",
    "hybrid_layer_pattern",
    "hybrid_layer_ids",
    "attn_type_list",
    "attn_layer_indices",
    "attn_layer_period",
    "full_attn_idxs",
    "full_attention_interval",
    "linear_attn_config",
    "sliding_window_pattern",
    "global_head_dim",
    "num_global_key_value_heads",
    "kv_lora_rank",
    "index_head_dim",
    "ssm_state_size",
    "state_size",
    "conv_L_cache",
    "conv_kernel",
)
_HYBRID_PREFIXES = ("mamba_", "linear_", "ssm_", "swa_")
_PATTERN_FIELDS = ("sliding_window_pattern", "full_attention_interval")


def generic_rule(cfg: ConfigView) -> tuple[list[LayerSpec], str]:
    """The layers of an unknown model_type and the `rule` line that says how they were read."""
    why = f"model_type {cfg.model_type!r} is not a known family"
    types = cfg.str_list("layer_types")
    if types is not None:
        unknown = [(i, t) for i, t in enumerate(types) if t not in _TYPES]
        if unknown:
            i, name = unknown[0]
            raise _refuse(cfg, f"layer_types[{i}] is {name!r}")
        # with the list given, a pattern field only restates it
        _check_plain(cfg, allowed={"sliding_window", "attention_chunk_size", *_PATTERN_FIELDS})
        cfg.layer_types()
        return layers_from_types(cfg, types, _TYPES), f"generic layer_types rule ({why})"
    if cfg.get("use_sliding_window") is True and cfg.get("sliding_window") is not None:
        if cfg.get("max_window_layers") is not None:
            raise _refuse(
                cfg,
                f"field 'max_window_layers' is {cfg.get('max_window_layers')!r} (which layers "
                "slide depends on the family)",
            )
        _check_plain(cfg, allowed={"sliding_window", "use_sliding_window"})
        layers = [LayerSpec(i, (sliding(cfg.layer(i)),)) for i in range(cfg.num_layers)]
        return layers, f"generic sliding-window rule ({why}; use_sliding_window is true)"
    _check_plain(cfg, allowed=set())
    if cfg.get("num_attention_heads") is None:
        raise _unsupported(cfg)
    layers = [LayerSpec(i, (full(cfg.layer(i)),)) for i in range(cfg.num_layers)]
    return layers, f"generic dense fallback ({why})"


def _check_plain(cfg: ConfigView, allowed: set[str]) -> None:
    """Refuse fields that suggest caches the generic rule cannot read."""
    for key, value in cfg.data.items():
        if key in allowed or value in (None, False, 0, "", [], {}):
            continue
        if key in _HYBRID_FIELDS or key.startswith(_HYBRID_PREFIXES):
            raise _refuse(cfg, f"field {key!r} is {_short(value)}")
        if key == "sliding_window" and cfg.get("use_sliding_window") is not False:
            raise _refuse(
                cfg,
                f"field 'sliding_window' is {_short(value)} but no 'layer_types' says which "
                "layers slide",
            )
        if key == "attention_chunk_size":
            raise _refuse(
                cfg,
                f"field 'attention_chunk_size' is {_short(value)} but no 'layer_types' says "
                "which layers are chunked",
            )
        if key == "num_kv_shared_layers":
            raise _refuse(cfg, f"field 'num_kv_shared_layers' is {_short(value)} (KV sharing)")
        if key == "v_head_dim" and value != cfg.get("head_dim"):
            raise _refuse(cfg, f"field 'v_head_dim' is {_short(value)} (a separate V width)")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _where(cfg: ConfigView) -> str:
    return f" ({cfg.source})" if cfg.source else ""


def _refuse(cfg: ConfigView, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"model_type {cfg.model_type!r}{_where(cfg)} is not a supported family and its {what}, "
        f"which the generic rule cannot read ({READS}). Supported model types: "
        f"{', '.join(supported_model_types())}. For this model, give an explicit layer list "
        f"in the deployment file, e.g.\n{EXPLICIT_EXAMPLE}"
    )


def _unsupported(cfg: ConfigView) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"model_type {cfg.model_type!r}{_where(cfg)} is not a supported family and its config "
        f"has no 'num_attention_heads' for the generic rule ({READS}). Supported model types: "
        f"{', '.join(supported_model_types())}. For another model, give an explicit layer "
        f"list in the deployment file, e.g.\n{EXPLICIT_EXAMPLE}"
    )
