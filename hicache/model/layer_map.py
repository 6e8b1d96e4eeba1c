"""`LayerMap`: the one place that turns global layer ids into (group, local id) and back.

Built from a `ModelLayout` and a pipeline stage (`start_layer`..`end_layer`, end exclusive).
Each cache group keeps only this stage's layers and numbers them 0..n-1 ("local ids"), so a
group whose global ids have gaps (Nemotron-H's attention at 4, 11, 18, ...) is dense here.
Guards answer "is layer i a full-attention layer?"; accessors (`local_id`, `to_global`) raise
a `LayerIdError` that says what the layer really is and which ids are valid.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from hicache.errors import (
    LayerIdError,
    LayerOutsideStageError,
    UnknownLayerError,
    WrongLayerKindError,
)
from hicache.model.layout import CacheGroup, ModelLayout
from hicache.model.specs import CacheKind, LayerSpec

_MAX_LISTED_IDS = 16


def format_ids(ids: tuple[int, ...] | list[int]) -> str:
    """`[5, 11, 17]`, or the first 16 and a count for long lists."""
    if len(ids) <= _MAX_LISTED_IDS:
        return "[" + ", ".join(map(str, ids)) + "]"
    head = ", ".join(map(str, ids[:_MAX_LISTED_IDS]))
    return f"[{head}, ... ({len(ids)} in all)]"


@dataclass(frozen=True, slots=True)
class LayerSlot:
    """Where one cache of one layer lives: its group and its local id there."""

    group: CacheGroup
    local_id: int


class LayerMap:
    def __init__(self, layout: ModelLayout, start_layer: int = 0, end_layer: int | None = None):
        end = layout.num_layers if end_layer is None else end_layer
        if not 0 <= start_layer < end <= layout.num_layers:
            raise LayerIdError(
                f"pipeline stage {start_layer}..{end} is not a layer range of "
                f"{layout.model_type}; allowed: 0 <= start_layer < end_layer <= "
                f"{layout.num_layers}"
            )
        self.layout = layout
        self.start_layer = start_layer
        self.end_layer = end
        self.groups: tuple[CacheGroup, ...] = tuple(
            CacheGroup(g.name, g.spec, ids)
            for g in layout.groups
            if (ids := tuple(i for i in g.layer_ids if start_layer <= i < end))
        )
        self._slots: dict[int, tuple[LayerSlot, ...]] = {}
        for group in self.groups:
            for local_id, layer_id in enumerate(group.layer_ids):
                self._slots[layer_id] = (*self._slots.get(layer_id, ()), LayerSlot(group, local_id))
        self._by_name = {g.name: g for g in self.groups}
        for layer_id in self.stage_layer_ids:
            source = layout.layers[layer_id].reuses
            if source is not None and not start_layer <= source < end:
                raise LayerIdError(
                    f"layer {layer_id} of {layout.model_type} reuses layer {source}'s KV, which "
                    f"is outside pipeline stage {start_layer}..{end}; a stage must hold the "
                    "layers whose KV it reads"
                )

    @property
    def model_type(self) -> str:
        return self.layout.model_type

    @property
    def stage_layer_ids(self) -> range:
        return range(self.start_layer, self.end_layer)

    def group(self, name: str) -> CacheGroup:
        try:
            return self._by_name[name]
        except KeyError:
            raise LayerIdError(
                f"{self.model_type} has no cache group {name!r} in pipeline stage "
                f"{self.start_layer}..{self.end_layer}; groups: {sorted(self._by_name)}"
            ) from None

    # ---- checked access -------------------------------------------------------------------

    def layer(self, layer_id: int) -> LayerSpec:
        """The layer's spec; raises if the id is not a layer of this stage."""
        if not isinstance(layer_id, int) or not 0 <= layer_id < self.layout.num_layers:
            raise UnknownLayerError(
                f"layer {layer_id!r} does not exist: {self.model_type} has layers "
                f"0..{self.layout.num_layers - 1}"
            )
        if not self.start_layer <= layer_id < self.end_layer:
            raise LayerOutsideStageError(
                f"layer {layer_id} of {self.model_type} is outside this pipeline stage; "
                f"this stage holds layers {self.start_layer}..{self.end_layer - 1}"
            )
        return self.layout.layers[layer_id]

    def stage_index(self, layer_id: int) -> int:
        """The layer's position in this stage (global id - start_layer), after the checks:
        the index the layer-done counter uses."""
        self.layer(layer_id)
        return layer_id - self.start_layer

    def slots(self, layer_id: int) -> tuple[LayerSlot, ...]:
        """Every cache the layer owns in this stage, as (group, local id); () if none."""
        self.layer(layer_id)
        return self._slots.get(layer_id, ())

    def local_id(self, layer_id: int, kind: CacheKind) -> LayerSlot:
        """The layer's slot in its `kind` group; raises `WrongLayerKindError` if it has none."""
        layer = self.layer(layer_id)
        for slot in self._slots.get(layer_id, ()):
            if slot.group.kind is kind:
                return slot
        valid = [i for i in self.stage_layer_ids if kind in self.layout.layers[i].kinds]
        raise WrongLayerKindError(
            f"layer {layer_id} of {self.model_type} is {layer.describe()}; "
            f"{kind.description} layers: {format_ids(valid) if valid else 'none'}"
        )

    def to_local(self, layer_id: int, group: str) -> int:
        """The layer's local id in the named group."""
        target = self.group(group)
        layer = self.layer(layer_id)
        for slot in self._slots.get(layer_id, ()):
            if slot.group.name == group:
                return slot.local_id
        raise WrongLayerKindError(
            f"layer {layer_id} of {self.model_type} is {layer.describe()}, not in group "
            f"{group!r}; its layers: {format_ids(target.layer_ids)}"
        )

    def to_global(self, group: str, local_id: int) -> int:
        target = self.group(group)
        if not isinstance(local_id, int) or not 0 <= local_id < len(target.layer_ids):
            raise LayerIdError(
                f"local id {local_id!r} is not in group {group!r} of {self.model_type}; "
                f"allowed: 0..{len(target.layer_ids) - 1}"
            )
        return target.layer_ids[local_id]

    def walk(self) -> Iterator[tuple[int, tuple[LayerSlot, ...]]]:
        """Layers of this stage in order with their slots; layers with no cache are skipped."""
        for layer_id in self.stage_layer_ids:
            slots = self._slots.get(layer_id)
            if slots:
                yield layer_id, slots

    # ---- guards ---------------------------------------------------------------------------

    def owns(self, layer_id: int, kind: CacheKind) -> bool:
        return kind in self.layer(layer_id).kinds

    def is_full_attention_layer(self, layer_id: int) -> bool:
        return self.owns(layer_id, CacheKind.FULL)

    def is_sliding_window_layer(self, layer_id: int) -> bool:
        return self.owns(layer_id, CacheKind.SLIDING)

    def is_chunked_attention_layer(self, layer_id: int) -> bool:
        return self.owns(layer_id, CacheKind.CHUNKED)

    def is_sparse_attention_layer(self, layer_id: int) -> bool:
        return self.owns(layer_id, CacheKind.SPARSE)

    def is_linear_attention_layer(self, layer_id: int) -> bool:
        return self.owns(layer_id, CacheKind.LINEAR)

    def is_mamba_layer(self, layer_id: int) -> bool:
        return self.owns(layer_id, CacheKind.MAMBA)

    def is_conv_layer(self, layer_id: int) -> bool:
        return self.owns(layer_id, CacheKind.CONV)

    def is_index_k_layer(self, layer_id: int) -> bool:
        """A sparse layer whose indexer keeps an index-K cache (with or without index V)."""
        return any(c.index is not None for c in self.layer(layer_id).caches)

    def is_index_kv_layer(self, layer_id: int) -> bool:
        """A sparse layer whose indexer keeps both index K and index V."""
        return any(c.index is not None and c.index.has_v for c in self.layer(layer_id).caches)

    def is_mla_layer(self, layer_id: int) -> bool:
        return any(
            c.kv_format is not None and c.kv_format.value == "mla"
            for c in self.layer(layer_id).caches
        )

    def is_kv_shared_layer(self, layer_id: int) -> bool:
        return self.layer(layer_id).reuses is not None

    def has_cache(self, layer_id: int) -> bool:
        return bool(self.layer(layer_id).caches)
