"""SGLang's device Mamba pool (`req_to_token_pool.mamba_pool`, a `MambaPool`) as the sidecar's
state group, slot for slot. No sglang import.

SGLang keeps, per state tensor, one allocation for every Mamba layer and slot:

    mamba_cache.conv[0]    [L, slots + 1, *conv]       layer l, slot s at (l * (slots+1) + s) * Rc
    mamba_cache.temporal   [L, slots + 1, *temporal]   layer l, slot s at (l * (slots+1) + s) * Rt

(Rc, Rt: one slot's bytes of one layer.) That is the state group's page rows: layer l's rows
start at l * (slots+1) * R, one slot (= one hicache state "page", one snapshot) R apart. The
sidecar's state group has a `conv` tensor and one recurrent / SSM tensor: conv maps to `conv`,
temporal to the other (as the storage backend's host mapping, `side_pools`). Refused by name
(`PoolShapeError`): several conv buffers, ReplaySSM ring buffers, an envelope layout (rows not
dense per slot), the AMX CPU conv layout (rows not the group's), layers or row bytes other than
the group's. A state is one snapshot: the state after page p is filed under the state group's
key of page p (the page it follows), as SGLang's MAMBA transfers name it by that page's hash.

Lifecycle: with the linker's other pools (`LinkedPools.of`, once, before the engine computes):
viewed and checked (`StateTensors.of`), shared in place or rebacked with them (`rebind` swaps
the pool's `mamba_cache` for one over the memfd), registered as the state group's rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from hicache.errors import PoolShapeError
from hicache.integrations.core.shared_memory import SharedRegions
from hicache.memory import DevicePool, GroupGeometry

CONV = "conv"


@dataclass
class StateTensors:
    """The Mamba pool's two tensors, by the sidecar's tensor names, and their layer ids."""

    tensors: dict[str, torch.Tensor]  # hicache tensor name -> [L, slots + 1, ...], its order
    layer_ids: tuple[int, ...]

    @classmethod
    def of(cls, mamba_pool: Any, geometry: GroupGeometry) -> StateTensors:
        cache = mamba_pool.mamba_cache
        conv, temporal = list(cache.conv), cache.temporal
        rings = [f.name for f in dataclasses.fields(cache) if f.name.startswith("replayssm_")]
        if len(conv) != 1 or any(getattr(cache, name) is not None for name in rings):
            raise PoolShapeError(
                f"SGLang's Mamba pool holds {len(conv)} conv buffers (or ReplaySSM rings); the "
                "linker moves one conv and one temporal state"
            )
        names = [name for name, _ in geometry.tensors]
        others = [name for name in names if name != CONV]
        if CONV not in names or len(others) != 1:
            raise PoolShapeError(
                f"the sidecar's state group {geometry.group.name!r} holds tensors {names}; "
                "SGLang's Mamba pool maps to 'conv' and one recurrent state"
            )
        by_name = {name: conv[0] if name == CONV else temporal for name in names}
        view = cls(by_name, tuple(mamba_pool.mamba_layer_ids))
        view.check(geometry)
        return view

    @property
    def num_pages(self) -> int:
        return min(t.shape[1] for t in self.tensors.values())

    def check(self, geometry: GroupGeometry) -> None:
        want = tuple(geometry.group.layer_ids)
        if self.layer_ids != want:
            raise PoolShapeError(
                f"SGLang's Mamba pool holds layers {list(self.layer_ids)}; the sidecar's state "
                f"group {geometry.group.name!r} layers {list(want)}"
            )
        for name, t in self.tensors.items():
            row = t[0, 0].numel() * t.element_size()
            dense = t.is_contiguous()
            if t.shape[0] != len(want) or not dense or row != geometry.row_bytes(name):
                raise PoolShapeError(
                    f"SGLang's Mamba {'conv' if name == CONV else 'temporal'} state (the "
                    f"sidecar's {name!r}) is {tuple(t.shape)} {t.dtype} (strides "
                    f"{t.stride()}): {row} bytes a slot and layer; the sidecar's state group "
                    f"{geometry.group.name!r} keeps {len(want)} layers of "
                    f"{geometry.row_bytes(name)} bytes, dense (check model.ssm_state_dtype, "
                    "and that SGLang's conv layout is the plain one, not AMX's)"
                )

    def all_tensors(self) -> list[torch.Tensor]:
        return list(self.tensors.values())

    def rebind(self, mamba_pool: Any, moved: list[torch.Tensor]) -> None:
        """The pool's `mamba_cache` replaced by one over `moved` (`all_tensors`' order)."""
        by_name = dict(zip(self.tensors, moved, strict=True))
        cache = mamba_pool.mamba_cache
        mamba_pool.mamba_cache = dataclasses.replace(
            cache, conv=[by_name[CONV]], temporal=next(t for n, t in by_name.items() if n != CONV)
        )

    def rows(self, memory: SharedRegions) -> tuple[list[list[int]], list[list[int]]]:
        """Per layer, each tensor's memfd offset and slot stride, in the geometry's order."""
        offsets, strides = [], []
        for layer in range(len(self.layer_ids)):
            offsets.append([memory.offset_of(t[layer].data_ptr()) for t in self.tensors.values()])
            strides.append([t.stride(1) * t.element_size() for t in self.tensors.values()])
        return offsets, strides

    def device_pools(self, geometry: GroupGeometry) -> dict[str, DevicePool]:
        """CUDA: the slots as the state group's pool, for `register_cuda_pools` (untested)."""
        layers = [
            {name: t[layer] for name, t in self.tensors.items()}
            for layer in range(len(self.layer_ids))
        ]
        return {geometry.group.name: DevicePool(geometry, layers)}


def state_slot(device_indices: Any) -> list[int] | None:
    """A MAMBA transfer's device indices (a tensor of one Mamba-pool slot, or a 0-d one) as
    the state group's one page; None unless exactly one slot."""
    slots = torch.as_tensor(device_indices, dtype=torch.int64).reshape(-1).tolist()
    return [int(slots[0])] if len(slots) == 1 else None
