"""Model layouts: which cache each layer owns, the cache groups, and the layer map with its
guards. No torch here. Entry points: `load_layout(path)`, `shard_layout(layout, tp_size)`
(one tensor-parallel rank's share), `LayerMap(layout, start, end)`, and
`model_identity(path, layout)` for the model name page keys are seeded with, and
`with_index_format(layout, ...)` (how a sparse layer's indexer keys are stored).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from hicache.errors import LayoutError
from hicache.model.explicit import ExplicitLayout
from hicache.model.hf_config import layout_from_hf_config, load_hf_layout
from hicache.model.identity import model_identity
from hicache.model.index_format import INDEX_FORMATS, with_index_format
from hicache.model.layer_map import LayerMap, LayerSlot
from hicache.model.layout import CacheGroup, ModelLayout
from hicache.model.specs import CacheKind, CacheSpec, IndexSpec, KvFormat, LayerSpec, StateShard
from hicache.model.tensor_parallel import kv_heads_per_rank, shard_layout

__all__ = [
    "INDEX_FORMATS",
    "CacheGroup",
    "CacheKind",
    "CacheSpec",
    "ExplicitLayout",
    "IndexSpec",
    "KvFormat",
    "LayerMap",
    "LayerSlot",
    "LayerSpec",
    "ModelLayout",
    "StateShard",
    "kv_heads_per_rank",
    "layout_from_hf_config",
    "load_layout",
    "model_identity",
    "shard_layout",
    "with_index_format",
]


def load_layout(path: Path | str) -> ModelLayout:
    """A layout from a `config.json` or from a YAML file holding an explicit layer list."""
    path = Path(path)
    if path.suffix == ".json":
        return load_hf_layout(path)
    if path.suffix in {".yaml", ".yml"}:
        from pydantic import ValidationError

        from hicache.config.errors import format_validation_error

        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise LayoutError(f"cannot read layer list {str(path)!r}: {exc}") from exc
        try:
            return ExplicitLayout.model_validate(data).to_layout(str(path))
        except ValidationError as exc:
            raise LayoutError(format_validation_error(exc, str(path))) from None
    raise LayoutError(
        f"cannot tell the format of {str(path)!r}; allowed: a Hugging Face config.json (.json) "
        "or an explicit layer list (.yaml / .yml)"
    )
