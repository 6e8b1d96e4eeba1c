"""Page rows and the CPU row-copy kernels.

`Rows` names which rows of a `[pages, row_bytes]` view an op touches: a contiguous run
(start, count) or an index tensor. Runs matter for speed: a run on the destination is one
gather, a run on the source is one scatter, and two index sets go through a preallocated
staging buffer. `copy_rows_cpu` picks the kernel for each case; the measurements behind the
choice are in docs/design.md ("CPU row kernels").
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class Rows:
    count: int
    start: int | None  # a run start..start+count, or None when `index` lists the rows
    index: torch.Tensor | None
    end: int  # one past the highest row: the kernels check it against the view's rows

    @classmethod
    def of(cls, ids: Sequence[int], device: torch.device | str = "cpu") -> Rows:
        count = len(ids)
        if count == 0:
            return cls(0, 0, None, 0)
        low, high = min(ids), max(ids)
        if low < 0:
            raise ValueError(f"row {low} is negative; rows are page numbers from 0")
        if high - low + 1 == count and all(ids[i] == ids[0] + i for i in range(count)):
            return cls(count, ids[0], None, high + 1)
        return cls(count, None, torch.tensor(list(ids), dtype=torch.int64, device=device), high + 1)

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
    """A uint8 `[n, row_bytes]` view as n numpy void items of row_bytes each (a view), so
    numpy moves one item per row (a memcpy of the row) instead of looping over its bytes."""
    array = rows.numpy()
    return array.view(np.dtype((np.void, array.shape[1])))[:, 0]


def _dense(rows: torch.Tensor) -> bool:
    """Rows packed back to back (a device tensor, a layer_first host block), not strided
    (a page_first host view). numpy's `take`/`put` are only fast on packed arrays: they copy
    or buffer anything else whole."""
    return rows.is_contiguous()


# From this row size up, a strided gather goes row by row with memcpy: measured on this CPU
# at 512 KiB rows, 0.94 of a contiguous copy against 0.87 for `index_select` into a strided
# view; at 128 KiB rows `index_select` still wins (0.95 against 0.88).
_ROW_LOOP_BYTES = 256 * 2**10


def _gather(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = src[index[i]] into a run of rows."""
    if _dense(src) and _dense(out):
        np.take(_items(src), index.numpy(), out=_items(out), mode="clip")  # bounds checked
    elif out.shape[1] >= _ROW_LOOP_BYTES and src.stride(1) == 1 and out.stride(1) == 1:
        _gather_row_by_row(src, index, out)
    else:
        wide_src, wide_out = widen(src, out)
        torch.index_select(wide_src, 0, index, out=wide_out)


def _gather_row_by_row(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """One memcpy per row (ctypes releases the GIL for each). Safe because every row index
    was checked against `src`'s rows and each row's bytes are contiguous in both views."""
    row_bytes = out.shape[1]
    src_at, src_step = src.data_ptr(), src.stride(0)
    out_at, out_step = out.data_ptr(), out.stride(0)
    for i, row in enumerate(index.tolist()):
        ctypes.memmove(out_at + i * out_step, src_at + row * src_step, row_bytes)


def _scatter(src: torch.Tensor, index: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[index[i]] = src[i] from a run of rows."""
    if _dense(src) and _dense(dst):
        np.put(_items(dst), index.numpy(), _items(src), mode="clip")  # bounds checked
    else:
        _items(dst)[index.numpy()] = _items(src)


def _check_bounds(label: str, rows: Rows, view: torch.Tensor) -> None:
    if rows.end > view.shape[0]:
        raise ValueError(
            f"{label} row {rows.end - 1} is outside the view's rows 0..{view.shape[0] - 1}"
        )


def check_row_pair(src: torch.Tensor, src_rows: Rows, dst: torch.Tensor, dst_rows: Rows) -> bool:
    """Raise ValueError, before anything is written, for a copy that cannot be right: counts
    that differ, row widths that differ, a row outside its view (on CUDA an index out of range
    would be a device-side assert, fatal to the process). False when there is nothing to
    copy."""
    if src_rows.count != dst_rows.count:
        raise ValueError(f"{src_rows.count} source rows but {dst_rows.count} destination rows")
    if src.shape[1] != dst.shape[1]:
        raise ValueError(
            f"source rows of {src.shape[1]} bytes but destination rows of {dst.shape[1]} bytes"
        )
    if src_rows.count == 0:
        return False
    _check_bounds("source", src_rows, src)
    _check_bounds("destination", dst_rows, dst)
    return True


def copy_rows_cpu(
    src: torch.Tensor, src_rows: Rows, dst: torch.Tensor, dst_rows: Rows, staging: torch.Tensor
) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for every i; views are `[pages, row_bytes]` uint8.

    Which kernel runs (measured on this CPU against a memcpy of the same bytes, see
    docs/design.md): a run on both sides is one copy; a run on one side is one gather
    (`np.take`) or one scatter (`np.put`) when both views are packed; into strided rows
    (page_first host pages), torch's `index_select`, or a memcpy per row for large rows; from
    strided rows, numpy's fancy assignment. None makes a temporary; two index sets go through
    the staging buffer. All of them release the GIL.
    """
    if not check_row_pair(src, src_rows, dst, dst_rows):
        return
    if src_rows.is_run and dst_rows.is_run:  # one contiguous copy
        np.copyto(_items(dst_rows.slice(dst)), _items(src_rows.slice(src)))
        return
    if dst_rows.is_run:
        assert src_rows.index is not None
        _gather(src, src_rows.index, dst_rows.slice(dst))
        return
    assert dst_rows.index is not None
    if src_rows.is_run:
        _scatter(src_rows.slice(src), dst_rows.index, dst)
        return
    # two index sets: gather into staging, scatter from it, a staging-full at a time
    assert src_rows.index is not None
    row_bytes = src.shape[1]
    per_round = staging.numel() // row_bytes
    if per_round == 0:  # a row larger than the staging buffer: copy row by row
        for s, d in zip(src_rows.index.tolist(), dst_rows.index.tolist(), strict=True):
            dst[d].copy_(src[s])
        return
    stage = staging[: per_round * row_bytes].view(per_round, row_bytes)
    for lo in range(0, src_rows.count, per_round):
        hi = min(lo + per_round, src_rows.count)
        part = stage[: hi - lo]
        _gather(src, src_rows.index[lo:hi], part)
        _scatter(part, dst_rows.index[lo:hi], dst)
