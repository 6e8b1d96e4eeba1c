"""Page rows and the CPU row-copy kernels.

`Rows` names which rows of a `[pages, row_bytes]` view an op touches: a contiguous run
(start, count) or an index tensor. Runs matter for speed: measured on this CPU (2 cores,
Llama-8B layer rows, see docs/design.md), torch's `index_select(out=)` gathers at 0.9-1.0 of
memcpy at >= 16-token pages, numpy's assignment of rows seen as void items scatters at ~1.0,
while torch's `index_copy_` scatter reaches only ~0.5. So: a run on the destination is one
gather, a run on the source is one scatter, and two index sets go through a preallocated
staging buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class Rows:
    count: int
    start: int | None  # a run start..start+count, or None when `index` lists the rows
    index: torch.Tensor | None

    @classmethod
    def of(cls, ids: Sequence[int], device: torch.device | str = "cpu") -> Rows:
        count = len(ids)
        if count and all(ids[i] == ids[0] + i for i in range(count)):
            return cls(count, ids[0], None)
        return cls(count, None, torch.tensor(list(ids), dtype=torch.int64, device=device))

    @property
    def is_run(self) -> bool:
        return self.start is not None

    def slice(self, view: torch.Tensor) -> torch.Tensor:
        assert self.start is not None
        return view[self.start : self.start + self.count]

    def ids(self) -> list[int]:
        if self.start is not None:
            return list(range(self.start, self.start + self.count))
        assert self.index is not None
        return [int(i) for i in self.index.tolist()]

    def runs(self) -> list[tuple[int, int, int]]:
        """(position in this set, first row, length) of each consecutive run."""
        ids = self.ids()
        out: list[tuple[int, int, int]] = []
        pos = 0
        while pos < len(ids):
            end = pos + 1
            while end < len(ids) and ids[end] == ids[end - 1] + 1:
                end += 1
            out.append((pos, ids[pos], end - pos))
            pos = end
        return out


_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _width_ok(t: torch.Tensor, width: int) -> bool:
    """Can this uint8 `[rows, row_bytes]` view be seen as `width`-byte items? (Checked with
    arithmetic: a failed `view` raises, and exceptions cost tens of microseconds.)"""
    return (
        t.stride(1) == 1
        and t.shape[1] % width == 0
        and t.stride(0) % width == 0
        and t.storage_offset() % width == 0
        and t.untyped_storage().data_ptr() % width == 0
    )


def widen(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both uint8 row views as the widest integer item both allow (fewer, larger items)."""
    for width, dtype in _WIDE:
        if _width_ok(a, width) and _width_ok(b, width):
            return a.view(dtype), b.view(dtype)
    return a, b


def _items(rows: torch.Tensor) -> np.ndarray:
    """A uint8 `[n, row_bytes]` view as n numpy void items of row_bytes each (a view). Fancy
    assignment then copies one item per row instead of looping over its elements: measured
    here 0.69 vs 0.58 of memcpy at 1-token rows, and no slower at larger ones."""
    array = rows.numpy()
    return array.view(np.dtype((np.void, array.shape[1])))[:, 0]


def copy_rows_cpu(
    src: torch.Tensor, src_rows: Rows, dst: torch.Tensor, dst_rows: Rows, staging: torch.Tensor
) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for every i; views are `[pages, row_bytes]` uint8."""
    if src_rows.count != dst_rows.count:
        raise ValueError(f"{src_rows.count} source rows but {dst_rows.count} destination rows")
    if src_rows.count == 0:
        return
    if src_rows.is_run and dst_rows.is_run:  # one contiguous memcpy
        dst_rows.slice(dst).copy_(src_rows.slice(src))
        return
    if dst_rows.is_run:  # one gather into the run
        assert src_rows.index is not None
        wide_src, wide_out = widen(src, dst_rows.slice(dst))
        torch.index_select(wide_src, 0, src_rows.index, out=wide_out)
        return
    assert dst_rows.index is not None
    dst_index = dst_rows.index.numpy()
    if src_rows.is_run:  # one scatter from the run
        _items(dst)[dst_index] = _items(src_rows.slice(src))
        return
    # two index sets: gather into staging, scatter from it, a staging-full at a time
    assert src_rows.index is not None
    row_bytes = src.shape[1]
    per_round = staging.numel() // row_bytes
    if per_round == 0:  # a row larger than the staging buffer: copy row by row
        for s, d in zip(src_rows.index.tolist(), dst_index.tolist(), strict=True):
            dst[d].copy_(src[s])
        return
    stage = staging[: per_round * row_bytes].view(per_round, row_bytes)
    for lo in range(0, src_rows.count, per_round):
        hi = min(lo + per_round, src_rows.count)
        part = stage[: hi - lo]
        wide_src, wide_part = widen(src, part)
        torch.index_select(wide_src, 0, src_rows.index[lo:hi], out=wide_part)
        _items(dst)[dst_index[lo:hi]] = _items(part)
