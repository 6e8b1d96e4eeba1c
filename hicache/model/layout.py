"""`ModelLayout`: the whole model's layers and the cache groups they form.

Lifecycle: a family rule (hf_config) or an explicit list (explicit) yields `LayerSpec`s;
`ModelLayout.build` validates them and groups equal `CacheSpec`s; a `LayerMap` then slices
the layout for one pipeline stage. Immutable after build.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hicache.errors import LayoutError
from hicache.model.specs import CacheKind, CacheSpec, LayerSpec


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """Layers that share one cache kind and geometry: one pool, local ids 0..n-1."""

    name: str
    spec: CacheSpec
    layer_ids: tuple[int, ...]  # global ids, ascending; local id = position

    @property
    def kind(self) -> CacheKind:
        return self.spec.kind

    @property
    def replicated(self) -> bool:
        """Every tensor-parallel rank holds the same bytes (`CacheSpec.replicated_across_ranks`)."""
        return self.spec.replicated_across_ranks


@dataclass(frozen=True, slots=True)
class ModelLayout:
    model_type: str
    layers: tuple[LayerSpec, ...]
    groups: tuple[CacheGroup, ...]
    source: str = ""  # where the layout came from, for messages
    rule: str = ""  # how it was derived: "family rule 'gemma3'", "generic dense fallback (...)"
    tp_size: int = 1  # the tensor-parallel size its specs are one rank's share of

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @classmethod
    def build(
        cls,
        model_type: str,
        layers: Sequence[LayerSpec],
        source: str = "",
        rule: str = "",
        tp_size: int = 1,
    ) -> ModelLayout:
        _validate(model_type, layers, source)
        return cls(model_type, tuple(layers), _group(layers), source, rule, tp_size)

    def group(self, name: str) -> CacheGroup:
        for group in self.groups:
            if group.name == name:
                return group
        names = [g.name for g in self.groups]
        raise LayoutError(f"{self.model_type} has no cache group {name!r}; groups: {names}")

    def layer_ids_of(self, kind: CacheKind) -> tuple[int, ...]:
        return tuple(layer.layer_id for layer in self.layers if kind in layer.kinds)

    @property
    def full_attention_layer_ids(self) -> tuple[int, ...]:
        return self.layer_ids_of(CacheKind.FULL)


def _validate(model_type: str, layers: Sequence[LayerSpec], source: str) -> None:
    where = f" ({source})" if source else ""
    if not layers:
        raise LayoutError(f"{model_type}{where}: the layout has no layers; at least 1 needed")
    for position, layer in enumerate(layers):
        if layer.layer_id != position:
            raise LayoutError(
                f"{model_type}{where}: layer at position {position} has id {layer.layer_id}; "
                "ids must be 0..num_layers-1 in order"
            )
        if layer.reuses is not None:
            if layer.caches:
                raise LayoutError(
                    f"{model_type}{where}: layer {position} both owns caches and reuses layer "
                    f"{layer.reuses}; a KV-sharing layer owns no cache"
                )
            if not 0 <= layer.reuses < position:
                raise LayoutError(
                    f"{model_type}{where}: layer {position} reuses layer {layer.reuses}; it "
                    f"must reuse an earlier layer (0..{position - 1})"
                )
            if layers[layer.reuses].reuses is not None or not layers[layer.reuses].caches:
                raise LayoutError(
                    f"{model_type}{where}: layer {position} reuses layer {layer.reuses}, which "
                    "owns no cache of its own"
                )
        kinds = [c.kind for c in layer.caches]
        if len(set(kinds)) != len(kinds):
            raise LayoutError(
                f"{model_type}{where}: layer {position} owns two caches of one kind {kinds}"
            )


def _group(layers: Sequence[LayerSpec]) -> tuple[CacheGroup, ...]:
    members: dict[CacheSpec, list[int]] = {}
    for layer in layers:
        for cache in layer.caches:
            members.setdefault(cache, []).append(layer.layer_id)
    per_kind: dict[CacheKind, int] = {}
    for spec in members:
        per_kind[spec.kind] = per_kind.get(spec.kind, 0) + 1
    seen: dict[CacheKind, int] = {}
    groups = []
    for spec, ids in members.items():
        name = spec.kind.value
        if per_kind[spec.kind] > 1:
            name = f"{name}_{seen.get(spec.kind, 0)}"
            seen[spec.kind] = seen.get(spec.kind, 0) + 1
        groups.append(CacheGroup(name, spec, tuple(ids)))
    return tuple(groups)
