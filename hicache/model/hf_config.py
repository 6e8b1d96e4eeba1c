"""Read a Hugging Face `config.json` into a `ModelLayout`.

Multimodal wrappers keep the decoder in `text_config` (or `llm_config` / `language_config`);
the rule is chosen by the decoder's `model_type` and the layout is named by the outer one.
A known family goes to its rule (`families`); an unknown one to the generic rule
(`families.generic`), which reads plain attention fields and refuses, naming the field,
anything hybrid it cannot size. The layout's `rule` says which of them was used.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hicache.errors import LayoutError
from hicache.model.families import family_of, rule_for
from hicache.model.families.common import ConfigView
from hicache.model.families.generic import generic_rule
from hicache.model.layout import ModelLayout

_DECODER_KEYS = ("text_config", "llm_config", "language_config")


def read_config_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise LayoutError(f"cannot read model config {str(path)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise LayoutError(
            f"model config {str(path)!r} is not UTF-8 text (byte {exc.object[exc.start]:#04x} "
            f"at offset {exc.start}); allowed: a config.json"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LayoutError(
            f"model config {str(path)!r} is not valid JSON: {exc.msg} at line {exc.lineno}"
        ) from exc
    if not isinstance(data, dict):
        raise LayoutError(f"model config {str(path)!r} holds {type(data).__name__}; an object")
    return data


def decoder_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decoder's part of a config: its `text_config` (etc.) in a multimodal wrapper."""
    for key in _DECODER_KEYS:
        if isinstance(config.get(key), dict):
            inner: Mapping[str, Any] = config[key]
            return inner
    return config


def layout_from_hf_config(config: Mapping[str, Any], source: str = "") -> ModelLayout:
    outer_type = config.get("model_type")
    if not isinstance(outer_type, str) or not outer_type:
        raise LayoutError(
            f"model config{f' ({source})' if source else ''} has no 'model_type'; "
            "a Hugging Face config.json names its family there"
        )
    decoder = decoder_config(config)
    inner_type = decoder.get("model_type")
    rule_type = inner_type if isinstance(inner_type, str) and rule_for(inner_type) else outer_type
    view = ConfigView(decoder, outer_type, source)
    rule = rule_for(rule_type)
    if rule is None:
        layers, how = generic_rule(view)
    else:
        layers = rule(view)
        how = f"family rule {family_of(rule_type)!r}"
        if rule_type != family_of(rule_type):
            how += f" (model_type {rule_type!r})"
    return ModelLayout.build(outer_type, layers, source, rule=how)


def load_hf_layout(path: Path) -> ModelLayout:
    return layout_from_hf_config(read_config_json(path), str(path))
