"""Read a Hugging Face `config.json` into a `ModelLayout`.

Multimodal wrappers keep the decoder in `text_config` (or `llm_config` / `language_config`);
the rule is chosen by the decoder's `model_type` and the layout is named by the outer one.
An unknown family falls back to generic fields (`layer_types`, or `sliding_window` with
`use_sliding_window`); without them the error lists the supported families and shows how to
give an explicit layer list instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hicache.errors import LayoutError, UnsupportedModelError
from hicache.model.families import rule_for, supported_model_types
from hicache.model.families.common import ConfigView, attention, full, layers_from_types, sliding
from hicache.model.layout import ModelLayout
from hicache.model.specs import CacheKind, LayerSpec

_DECODER_KEYS = ("text_config", "llm_config", "language_config")

EXPLICIT_EXAMPLE = """\
model:
  model_type: my-model
  layers:
    - {repeat: 3, kind: sliding, kv_heads: 8, head_dim: 128, window_tokens: 1024}
    - {kind: full, kv_heads: 8, head_dim: 128}"""


def read_config_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise LayoutError(f"cannot read model config {str(path)!r}: {exc.strerror}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LayoutError(
            f"model config {str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno}"
        ) from exc
    if not isinstance(data, dict):
        raise LayoutError(f"model config {str(path)!r} holds {type(data).__name__}; an object")
    return data


def layout_from_hf_config(config: Mapping[str, Any], source: str = "") -> ModelLayout:
    outer_type = config.get("model_type")
    if not isinstance(outer_type, str) or not outer_type:
        raise LayoutError(
            f"model config{f' ({source})' if source else ''} has no 'model_type'; "
            "a Hugging Face config.json names its family there"
        )
    decoder: Mapping[str, Any] = config
    for key in _DECODER_KEYS:
        if isinstance(config.get(key), dict):
            decoder = config[key]
            break
    inner_type = decoder.get("model_type")
    rule_type = inner_type if isinstance(inner_type, str) and rule_for(inner_type) else outer_type
    view = ConfigView(decoder, outer_type, source)
    rule = rule_for(rule_type)
    layers = rule(view) if rule is not None else _generic(view)
    return ModelLayout.build(outer_type, layers, source)


def load_hf_layout(path: Path) -> ModelLayout:
    return layout_from_hf_config(read_config_json(path), str(path))


def _generic(cfg: ConfigView) -> list[LayerSpec]:
    types = cfg.layer_types()
    if types is not None:
        return layers_from_types(
            cfg,
            types,
            {
                "full_attention": lambda: (full(cfg),),
                "sliding_attention": lambda: (sliding(cfg),),
                "chunked_attention": lambda: (
                    attention(cfg, CacheKind.CHUNKED, chunk=cfg.req_int("attention_chunk_size")),
                ),
            },
        )
    if cfg.get("use_sliding_window") is True and cfg.get("sliding_window") is not None:
        return [LayerSpec(i, (sliding(cfg),)) for i in range(cfg.num_layers)]
    supported = ", ".join(supported_model_types())
    raise UnsupportedModelError(
        f"model_type {cfg.model_type!r}{f' ({cfg.source})' if cfg.source else ''} is not a "
        f"supported family and its config has no generic 'layer_types' (or 'sliding_window' "
        f"with 'use_sliding_window'). Supported model types: {supported}. For another model, "
        f"give an explicit layer list in the deployment file, e.g.\n{EXPLICIT_EXAMPLE}"
    )
