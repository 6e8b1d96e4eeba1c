"""vLLM's KV tensors bound to hicache's layout, without vLLM: per layer, vLLM's blocks as byte
rows, checked against hicache's page geometry, and the whole-block copies between them and a
staging pool laid out as hicache's device pool.

Built once at `register_kv_caches`; immutable after. A vLLM block is a hicache page and is
copied as opaque bytes: vLLM's CPU backend packs K and V inside a block differently per
instruction set, so nothing here reads a token. An attention layer's block
(`[num_blocks, kv_heads, block_size, 2 * head_size]`) must be exactly one hicache page of that
layer (K then V rows); a state layer's page (`[num_blocks, 1, 1, page_bytes]`, strided) holds
the state's tensors from byte 0 (vLLM pads the page; the padding is not copied), and their
element counts and dtypes must match hicache's state geometry tensor by tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hicache.errors import PoolShapeError
from hicache.memory import DevicePool, GroupGeometry
from hicache.memory.geometry import dtype_name
from hicache.model import LayerMap


@dataclass(frozen=True, slots=True)
class StateSpec:
    """A vLLM state layer's tensors (MambaSpec.shapes / .dtypes), in page order."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes, strict=True))


@dataclass(frozen=True, slots=True)
class LayerBinding:
    """One hicache layer: vLLM's blocks of it as `[num_blocks, page_bytes]` uint8 rows, the
    vLLM KV-cache group whose block ids index them, and each hicache tensor's byte range."""

    layer_id: int
    vllm_name: str
    group: str  # hicache group
    local_id: int
    vllm_group: int
    blocks: torch.Tensor
    parts: tuple[tuple[str, int, int], ...]  # (hicache tensor, first byte, end byte)

    def to_staging(self, pool: DevicePool, block_ids: Sequence[int], pages: Sequence[int]) -> None:
        """Copy vLLM blocks `block_ids` into staging `pages` (same length)."""
        for name, start, end in self.parts:
            rows = pool.rows(self.local_id, name)
            for block, page in zip(block_ids, pages, strict=True):
                rows[page].copy_(self.blocks[block, start:end])

    def from_staging(
        self, pool: DevicePool, pages: Sequence[int], block_ids: Sequence[int]
    ) -> None:
        """Copy staging `pages` into vLLM blocks `block_ids`. One contiguous copy per block
        and tensor: fancy indexing into the strided byte slices ran at ~0.8 GB/s here, a
        row copy runs at memcpy speed."""
        for name, start, end in self.parts:
            rows = pool.rows(self.local_id, name)
            for page, block in zip(pages, block_ids, strict=True):
                self.blocks[block, start:end].copy_(rows[page])


def block_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A `[num_blocks, ...]` tensor whose per-block bytes are contiguous, as uint8 rows (a
    view: copies into it land in vLLM's memory)."""
    inner = tensor[0]
    if not inner.is_contiguous():
        raise PoolShapeError(
            f"a block of shape {tuple(inner.shape)} with strides {inner.stride()} is not "
            "contiguous; hicache copies whole blocks as bytes"
        )
    nbytes = inner.numel() * tensor.element_size()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
        tensor.untyped_storage(),
        tensor.storage_offset() * tensor.element_size(),
        (tensor.shape[0], nbytes),
        (tensor.stride(0) * tensor.element_size(), 1),
    )


def bind_layers(
    layer_map: LayerMap,
    geometries: Mapping[str, GroupGeometry],
    kv_caches: Mapping[str, torch.Tensor],
    layer_index: Mapping[str, int],
    vllm_group: Mapping[str, int],
    state_specs: Mapping[str, StateSpec],
) -> dict[int, LayerBinding]:
    """Every hicache layer of the stage bound to vLLM's tensor of that layer; an error names
    the layer, what vLLM gives and what hicache's layout expects."""
    by_layer: dict[int, str] = {}
    for name in kv_caches:
        layer_id = layer_index[name]
        if layer_id in by_layer:
            raise PoolShapeError(
                f"vLLM layers {by_layer[layer_id]!r} and {name!r} both map to layer {layer_id}; "
                "hicache keeps one cache per layer and kind"
            )
        by_layer[layer_id] = name
    bound: dict[int, LayerBinding] = {}
    for geometry in geometries.values():
        group = geometry.group
        for local_id, layer_id in enumerate(group.layer_ids):
            vllm_name = by_layer.get(layer_id)
            if vllm_name is None:
                raise PoolShapeError(
                    f"layer {layer_id} ({group.kind.description}, hicache group {group.name!r}) "
                    f"has no KV tensor in vLLM's register_kv_caches; vLLM gave layers "
                    f"{sorted(by_layer)}"
                )
            bound[layer_id] = _bind_one(
                geometry,
                local_id,
                layer_id,
                vllm_name,
                kv_caches[vllm_name],
                vllm_group[vllm_name],
                state_specs.get(vllm_name),
            )
    extra = sorted(set(by_layer) - set(bound))
    if extra:
        raise PoolShapeError(
            f"vLLM has KV tensors for layers {extra} ({by_layer[extra[0]]!r}, ...) that hicache's "
            f"layout of {layer_map.model_type} gives no cache; the model's config.json and the "
            "sidecar's model disagree"
        )
    return bound


def _bind_one(
    geometry: GroupGeometry,
    local_id: int,
    layer_id: int,
    name: str,
    tensor: torch.Tensor,
    vllm_group: int,
    state: StateSpec | None,
) -> LayerBinding:
    group = geometry.group
    where = f"layer {layer_id} ({name!r}, hicache group {group.name!r})"
    rows = block_rows(tensor)
    parts, offset = [], 0
    for tensor_name, _shape in geometry.tensors:
        size = geometry.row_bytes(tensor_name)
        parts.append((tensor_name, offset, offset + size))
        offset += size
    if group.kind.is_token_cache:
        if state is not None:
            raise PoolShapeError(f"{where}: vLLM keeps a state here; hicache a token cache")
        if rows.shape[1] != offset:
            raise PoolShapeError(
                f"{where}: a vLLM block is {rows.shape[1]} bytes (tensor "
                f"{tuple(tensor.shape)} {tensor.dtype}); hicache's page of this layer is "
                f"{offset} bytes ({_describe(geometry)}): the block size, KV heads, head size "
                "or dtype differ"
            )
    else:
        if state is None:
            raise PoolShapeError(
                f"{where}: hicache keeps a {group.kind.description} state here; vLLM gives no "
                "state spec (MambaSpec) for this layer"
            )
        _check_state(geometry, where, state)
        if rows.shape[1] < offset:
            raise PoolShapeError(
                f"{where}: vLLM's state page is {rows.shape[1]} bytes; hicache's state is "
                f"{offset} bytes ({_describe(geometry)})"
            )
        rows = rows[:, :offset]
    return LayerBinding(layer_id, name, group.name, local_id, vllm_group, rows, tuple(parts))


def _check_state(geometry: GroupGeometry, where: str, state: StateSpec) -> None:
    ours = [
        (name, math.prod(shape) * geometry.slots_per_page, geometry.dtype_of(name))
        for name, shape in geometry.tensors
    ]
    theirs = [(math.prod(s), d) for s, d in zip(state.shapes, state.dtypes, strict=True)]
    if len(ours) != len(theirs) or any(
        (n, d) != (tn, td) for (_, n, d), (tn, td) in zip(ours, theirs, strict=False)
    ):
        mine = ", ".join(f"{name} {n} x {dtype_name(d)}" for name, n, d in ours)
        vllm = ", ".join(
            f"{tuple(s)} {dtype_name(d)}" for s, d in zip(state.shapes, state.dtypes, strict=True)
        )
        raise PoolShapeError(
            f"{where}: vLLM's state tensors are {vllm}; hicache's geometry for this family is "
            f"{mine} (elements x dtype): the state shapes or dtypes differ (set model.state_dtype "
            "/ model.ssm_state_dtype to vLLM's mamba_cache_dtype / mamba_ssm_cache_dtype)"
        )


def _describe(geometry: GroupGeometry) -> str:
    return (
        ", ".join(
            f"{name} {list(shape)} {dtype_name(geometry.dtype_of(name))}"
            for name, shape in geometry.tensors
        )
        + f" per slot, {geometry.slots_per_page} slots per page"
    )
