"""`HostPool`: one cache group's L2 pages in one preallocated host buffer.

Two layouts of the same bytes:
- `layer_first`: [layer][tensor][page][row bytes]: each (layer, tensor) is one contiguous
  block, so a run of pages is one contiguous range (the fastest per-layer copies);
- `page_first`: [page][layer][tensor][row bytes]: all layers of a page are contiguous, so a
  page is one object for L3 (`page_record`); per-layer rows are strided views.
The buffer comes from the copy backend (pinned and registered in chunks on CUDA) and is never
reallocated; pages are handed out by a `PageAllocator` with pins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from hicache.errors import PoolShapeError
from hicache.memory.geometry import GroupGeometry
from hicache.memory.page_allocator import PageAllocator

HostLayout = Literal["layer_first", "page_first"]


@dataclass(frozen=True, slots=True)
class HostPoolStats:
    num_pages: int
    page_bytes: int
    free_pages: int
    pinned_pages: int  # pages a copy still reads or writes

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes


class HostPool:
    def __init__(
        self, geometry: GroupGeometry, num_pages: int, layout: HostLayout, buffer: torch.Tensor
    ):
        need = num_pages * geometry.page_bytes
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < need:
            raise PoolShapeError(
                f"host pool {geometry.name!r}: buffer of {buffer.numel()} {buffer.dtype} "
                f"elements; needs a 1-D uint8 buffer of at least {need} bytes"
            )
        self.geometry = geometry
        self.num_pages = num_pages
        self.layout = layout
        self.buffer = buffer[:need]
        self.allocator = PageAllocator(num_pages, f"host pool {geometry.name!r}")
        self._rows = [
            {name: self._make_rows(local_id, name) for name, _ in geometry.tensors}
            for local_id in range(geometry.num_layers)
        ]
        self._layer_rows = [tuple(r[name] for name, _ in geometry.tensors) for r in self._rows]

    def _tensor_offset(self, tensor: str) -> int:
        offset = 0
        for name, _ in self.geometry.tensors:
            if name == tensor:
                return offset
            offset += self.geometry.row_bytes(name)
        raise KeyError(tensor)

    def _make_rows(self, local_id: int, tensor: str) -> torch.Tensor:
        g, row = self.geometry, self.geometry.row_bytes(tensor)
        if self.layout == "layer_first":
            start = (
                local_id * g.page_bytes_per_layer + self._tensor_offset(tensor)
            ) * self.num_pages
            return self.buffer[start : start + self.num_pages * row].view(self.num_pages, row)
        start = local_id * g.page_bytes_per_layer + self._tensor_offset(tensor)
        return self.buffer.as_strided((self.num_pages, row), (g.page_bytes, 1), start)

    def layer_rows(self, local_id: int) -> tuple[torch.Tensor, ...]:
        """Every tensor's row view of one layer, in the geometry's tensor order."""
        return self._layer_rows[local_id]

    def rows(self, local_id: int, tensor: str) -> torch.Tensor:
        """`[num_pages, row_bytes]` uint8 view (strided for page_first)."""
        return self._rows[local_id][tensor]

    def page_chunks(self, page: int) -> list[torch.Tensor]:
        """The bytes of one page across all layers, in record order: one contiguous chunk for
        page_first, one chunk per (layer, tensor) for layer_first."""
        if self.layout == "page_first":
            size = self.geometry.page_bytes
            return [self.buffer[page * size : (page + 1) * size]]
        return [rows[name][page] for rows in self._rows for name, _ in self.geometry.tensors]

    def page_views(self, page: int) -> list[memoryview]:
        """`page_chunks` as memoryviews, uncopied (what L3 puts read and fetches fill)."""
        return [chunk.numpy().data for chunk in self.page_chunks(page)]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def stats(self) -> HostPoolStats:
        allocator = self.allocator.stats()
        return HostPoolStats(
            self.num_pages, self.geometry.page_bytes, allocator.free_pages, allocator.pinned_pages
        )
