"""Family rules: one function per model family that turns a decoder config into layers.

A rule is registered under every `model_type` its family uses (`@family("gemma3",
"gemma3_text")`). `rule_for` finds it; `family_of` names the family (its first model_type)
for the layout's `rule` line; `supported_model_types` lists them for messages. Each rule
follows the model's own code: the config's fields first, then the family's documented
defaults for fields a checkpoint leaves out.
"""

from __future__ import annotations

from collections.abc import Callable

from hicache.model.families.common import ConfigView
from hicache.model.specs import LayerSpec

Rule = Callable[[ConfigView], list[LayerSpec]]
_RULES: dict[str, Rule] = {}
_FAMILY_NAMES: dict[str, str] = {}


def family(*model_types: str) -> Callable[[Rule], Rule]:
    def register(rule: Rule) -> Rule:
        for model_type in model_types:
            if model_type in _RULES:
                raise RuntimeError(f"model_type {model_type!r} registered twice")
            _RULES[model_type] = rule
            _FAMILY_NAMES[model_type] = model_types[0]
        return rule

    return register


def rule_for(model_type: str) -> Rule | None:
    _load()
    return _RULES.get(model_type)


def family_of(model_type: str) -> str | None:
    """The family a model_type belongs to (`gemma3_text` -> `gemma3`), or None if unknown."""
    _load()
    return _FAMILY_NAMES.get(model_type)


def supported_model_types() -> list[str]:
    _load()
    return sorted(_RULES)


def _load() -> None:
    # The rule modules register themselves on import.
    from hicache.model.families import attention, latent, linear, ssm  # noqa: F401
