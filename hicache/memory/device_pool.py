"""`DevicePool`: one cache group's L1 tensors, as the engine owns them or allocated for the demo.

Per local layer, one tensor per name (K, V, latent, index K, conv, ssm, ...) shaped
`[num_slots, *slot_shape]`. Wrapping checks every shape, dtype and layout against the group's
geometry and names what is wrong. Copies see each tensor as byte rows, one row per page
(`rows()`), so page moves are dtype-agnostic (bf16, fp16, fp32, fp8-as-uint8, ...).
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
            {name: page_rows(t[name], geometry.slots_per_page) for name in names} for t in layers
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
