"""How a sparse-attention layer's indexer keys are stored: the deployment's `model.index_format`.

A config.json says how wide an indexer key is (`index_head_dim`), not how an engine keeps it.
transformers caches it in the KV's dtype ("kv_dtype", the default); DeepSeek's inference code,
SGLang's DSA pool and vLLM's indexer cache keep it as float8_e4m3fn with one float32 scale per
128 dims ("fp8_scaled": 132 bytes a token for DeepSeek-V3.2 and GLM-5; a page's keys, then its
scales — the `index_k` and `index_k_scale` rows of hicache's page). Every party of a deployment
builds its layout through `LoadedConfig.layout`, so they all agree; the format is part of the
layout's description, so pages of one format are never served to an engine of the other.
A model with no indexer is unchanged by either value.
"""

from __future__ import annotations

from dataclasses import replace

from hicache.errors import ConfigError
from hicache.model.layout import ModelLayout
from hicache.model.specs import CacheSpec, LayerSpec

INDEX_FORMATS = ("kv_dtype", "fp8_scaled")
FP8_BLOCK = 128  # dims per float32 scale, as DeepSeek's indexer quantizes its keys


def with_index_format(layout: ModelLayout, index_format: str, source: str) -> ModelLayout:
    """`layout` with its indexer keys stored as `index_format` (module doc); `source` names
    where the value came from in errors."""
    if index_format not in INDEX_FORMATS:
        raise ConfigError(
            f"model.index_format is {index_format!r} (from {source}); allowed: "
            + ", ".join(INDEX_FORMATS)
        )
    if index_format == "kv_dtype" or not any(
        spec.index is not None and spec.index.fp8_block is None
        for layer in layout.layers
        for spec in layer.caches
    ):
        return layout

    def scaled(spec: CacheSpec, layer_id: int) -> CacheSpec:
        if spec.index is None or spec.index.fp8_block is not None:
            return spec
        try:
            return replace(spec, index=replace(spec.index, fp8_block=FP8_BLOCK))
        except ValueError as exc:
            raise ConfigError(
                f"model.index_format is 'fp8_scaled' (from {source}) but layer {layer_id} of "
                f"{layout.model_type} cannot be: {exc}; allowed: kv_dtype for this model"
            ) from exc

    layers = [
        LayerSpec(
            layer.layer_id,
            tuple(scaled(spec, layer.layer_id) for spec in layer.caches),
            layer.reuses,
        )
        for layer in layout.layers
    ]
    rule = f"{layout.rule}, indexer keys fp8_scaled" if layout.rule else ""
    return ModelLayout.build(layout.model_type, layers, layout.source, rule, layout.tp_size)
