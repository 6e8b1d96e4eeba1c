"""`DevicePool`: one cache group's L1 tensors, as the engine owns them or allocated for the demo.

Per local layer, one tensor per name (K, V, latent, index K, conv, ssm, ...) shaped
`[num_slots, *slot_shape]`. Wrapping checks every shape, dtype and layout against the group's
geometry and names what is wrong. Copies see each tensor as byte rows, one row per page
(`rows()`), so page moves are dtype-agnostic (bf16, fp16, fp32, fp8-as-uint8, ...).

An engine whose pages are not laid out slot-major per tensor (vLLM keeps a layer's K and V
bytes side by side in each block, blocks at a stride) gives a tensor as its page rows
instead: a uint8 `[num_pages, page_bytes]` view, each row contiguous, rows at any stride of at
least a row. Such a pool is copied like any other; only its `tensors` are
rows, not typed slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hicache.errors import PoolShapeError
from hicache.memory.geometry import GroupGeometry
from hicache.memory.hugepages import advise_hugepages


def page_rows(tensor: torch.Tensor, slots_per_page: int) -> torch.Tensor:
    """A contiguous `[slots, ...]` tensor seen as `[pages, page_bytes]` uint8 rows (a view)."""
    flat = tensor.view(tensor.shape[0], -1)
    return flat.view(torch.uint8).view(tensor.shape[0] // slots_per_page, -1)


def _is_page_rows(t: torch.Tensor, row_bytes: int) -> bool:
    """A uint8 `[pages, row_bytes]` view whose rows are contiguous and do not overlap."""
    return (
        t.dtype == torch.uint8
        and t.dim() == 2
        and t.shape[1] == row_bytes
        and t.stride(1) == 1
        and (t.shape[0] <= 1 or t.stride(0) >= row_bytes)
    )


def _is_slots(t: torch.Tensor, shape: Sequence[int]) -> bool:
    return t.dim() == 1 + len(shape) and tuple(t.shape[1:]) == tuple(shape) and t.is_contiguous()


class DevicePool:
    def __init__(self, geometry: GroupGeometry, layers: Sequence[Mapping[str, torch.Tensor]]):
        self.geometry = geometry
        group = geometry.group
        if len(layers) != geometry.num_layers:
            raise PoolShapeError(
                f"group {group.name!r}: {len(layers)} layers of tensors given; the group has "
                f"{geometry.num_layers} (layers {list(group.layer_ids)})"
            )
        names = [name for name, _ in geometry.tensors]
        num_slots: int | None = None
        given_rows: set[tuple[int, str]] = set()  # (local id, tensor) given as page rows
        for local_id, tensors in enumerate(layers):
            layer_id = group.layer_ids[local_id]
            if sorted(tensors) != sorted(names):
                raise PoolShapeError(
                    f"group {group.name!r} layer {layer_id}: tensors {sorted(tensors)} given; "
                    f"expected {sorted(names)}"
                )
            for name, shape in geometry.tensors:
                t = tensors[name]
                where = f"group {group.name!r} layer {layer_id} tensor {name!r}"
                if _is_page_rows(t, geometry.row_bytes(name)) and not _is_slots(t, shape):
                    pages = t.shape[0]
                    if num_slots is None:
                        num_slots = pages * geometry.slots_per_page
                    if pages * geometry.slots_per_page != num_slots:
                        raise PoolShapeError(
                            f"{where}: {pages} page rows; the pool's other tensors hold "
                            f"{num_slots // geometry.slots_per_page} pages"
                        )
                    given_rows.add((local_id, name))
                    continue
                if num_slots is None:
                    num_slots = t.shape[0] if t.dim() else 0
                want = (num_slots, *shape)
                if tuple(t.shape) != want:
                    raise PoolShapeError(f"{where}: shape {tuple(t.shape)}; expected {want}")
                if not geometry.accepts_dtype(name, t.dtype):
                    want_dtype = geometry.dtype_of(name)
                    also = " (or torch.uint8 holding its bytes)" if want_dtype.itemsize == 1 else ""
                    raise PoolShapeError(
                        f"{where}: dtype {t.dtype}; expected {want_dtype}{also}; model.dtype sets "
                        "the KV's, model.state_dtype and model.ssm_state_dtype the states'"
                    )
                if not t.is_contiguous():
                    raise PoolShapeError(
                        f"{where}: not contiguous; page copies need contiguous slots"
                    )
        assert num_slots is not None
        if num_slots == 0 or num_slots % geometry.slots_per_page:
            raise PoolShapeError(
                f"group {group.name!r}: {num_slots} slots is not a positive multiple of the page "
                f"size ({geometry.slots_per_page} slots per page)"
            )
        self.num_slots = num_slots
        self.num_pages = num_slots // geometry.slots_per_page
        self.device = next(iter(layers[0].values())).device
        self.tensors = [dict(t) for t in layers]
        self._rows = [
            {
                name: t[name]
                if (local_id, name) in given_rows
                else page_rows(t[name], geometry.slots_per_page)
                for name in names
            }
            for local_id, t in enumerate(layers)
        ]
        self._layer_rows = [tuple(r[name] for name in names) for r in self._rows]

    @classmethod
    def allocate(
        cls, geometry: GroupGeometry, num_pages: int, device: torch.device | str = "cpu"
    ) -> DevicePool:
        """A pool of our own (the demo's stand-in for the engine's), zero-filled."""
        slots = num_pages * geometry.slots_per_page
        layers = []
        for _ in range(geometry.num_layers):
            tensors = {}
            for name, shape in geometry.tensors:
                t = torch.empty((slots, *shape), dtype=geometry.dtype_of(name), device=device)
                advise_hugepages(t)
                tensors[name] = t.zero_()
            layers.append(tensors)
        return cls(geometry, layers)

    def layer_rows(self, local_id: int) -> tuple[torch.Tensor, ...]:
        """Every tensor's row view of one layer, in the geometry's tensor order."""
        return self._layer_rows[local_id]

    def rows(self, local_id: int, tensor: str) -> torch.Tensor:
        """`[num_pages, row_bytes]` uint8 view of one layer's tensor."""
        return self._rows[local_id][tensor]

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.geometry.page_bytes
