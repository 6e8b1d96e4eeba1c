"""Page rows and the CPU row-copy kernels.

`Rows` names which rows of a `[pages, row_bytes]` view an op touches: a contiguous run
(start, count) or an index tensor. `copy_rows_cpu` copies them. Its kernel, when the native
one is available (`hicache/transfer/native`: a C loop over rows, each copied by an AVX2 loop
below 16 KiB and memcpy above — or streaming stores for a call of 8 MiB or more where this
process measured them faster, `store_mode` — built with the system compiler on first use,
called through ctypes with the GIL released), is that loop for
every case but a packed run to a packed run (one memcpy): run or index set on either side,
packed or strided views, no staging. Where it is not (no compiler, a failed build, an unsafe
cache folder; one warning says which), the numpy kernels: a run on the destination is one
gather, a run on the source one scatter, and two index sets go through the staging buffer in
cache-sized blocks (gather a block, scatter it while it is still in cache). The measurements
behind the choice are in docs/design.md ("CPU row kernels"); `row_kernel_name()` says which
is in use.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hicache.transfer import native

log = logging.getLogger("hicache.transfer")


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


# float64 before int64: torch's index_select into a strided `out` (page_first host rows)
# measured 1.32 of memcpy as float64 and 0.96 as int64 at 512 KiB rows. A copy moves the
# bits untouched (no arithmetic, so NaN payloads and denormals survive; a test checks).
_WIDE = ((8, torch.float64), (4, torch.int32), (2, torch.int16))


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
    """Both uint8 row views as the widest item both allow (fewer, larger items)."""
    for width, dtype in _WIDE:
        if _width_ok(a, width) and _width_ok(b, width):
            return a.view(dtype), b.view(dtype)
    return a, b


# numpy releases the GIL only for loops over more items than this (NPY_BEGIN_THREADS_
# THRESHOLDED); with a few hundred large rows as items it would hold it for the whole copy.
_NUMPY_GIL_FREE_ITEMS = 500


def sub_items(rows: torch.Tensor, split: int) -> np.ndarray:
    """A uint8 `[n, row_bytes]` view (rows contiguous, possibly strided) as an `[n, split]`
    numpy array of void items of row_bytes/split bytes each (a view): numpy then moves one
    item per memcpy instead of looping over bytes."""
    n, row = rows.shape
    return rows.view(n, split, row // split).numpy().view(np.dtype((np.void, row // split)))[..., 0]


def split_for(count: int, row_bytes: int) -> int:
    """Sub-items per row so that numpy's loop runs over more than 500 items and releases the
    GIL (halving the item while the row divides evenly and items stay >= 256 bytes)."""
    split = 1
    while (
        count * split <= _NUMPY_GIL_FREE_ITEMS
        and row_bytes % (2 * split) == 0
        and row_bytes // (2 * split) >= 256
    ):
        split *= 2
    return split


def _gather(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = src[index[i]] into a run of rows: numpy's `take` when both are packed (it
    copies or buffers a strided `out` whole), torch's `index_select` otherwise."""
    if src.is_contiguous() and out.is_contiguous():
        split = split_for(out.shape[0], out.shape[1])
        items = sub_items(out, split)
        np.take(sub_items(src, split), index.numpy(), axis=0, out=items, mode="clip")
    else:
        wide_src, wide_out = widen(src, out)
        torch.index_select(wide_src, 0, index, out=wide_out)


def _scatter(src: torch.Tensor, index: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[index[i]] = src[i] from a run of rows (packed or strided)."""
    split = split_for(src.shape[0], src.shape[1])
    sub_items(dst, split)[index.numpy()] = sub_items(src, split)


def _copy_run(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[:] = src for two runs of rows: one memcpy when both are packed, else torch's copy
    (strided rows). Both release the GIL for the whole copy."""
    if src.is_contiguous() and dst.is_contiguous():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
    else:
        dst.copy_(src)


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
    for label, view in (("source", src), ("destination", dst)):
        if view.dim() != 2 or view.dtype != torch.uint8 or view.stride(1) != 1:
            raise ValueError(
                f"the {label} is a {view.dtype} view of shape {tuple(view.shape)} and strides "
                f"{view.stride()}; copies need [rows, row_bytes] uint8 views whose bytes "
                "within a row are contiguous"
            )
    if src_rows.count == 0:
        return False
    _check_bounds("source", src_rows, src)
    _check_bounds("destination", dst_rows, dst)
    return True


# Blocks of the numpy kernel for two index sets: gather a block into staging, scatter it out
# while it is still in cache. Churned loads and backups (benchmarks/transfer.py
# --numpy-kernel, blocks of 256 KiB to 64 MiB) ran fastest with 2-8 MiB blocks, 1.3-1.4x the
# old single round through a 64 MiB buffer; 256 KiB lost (a Python round trip per block) and
# 16 MiB or more fall out of this CPU's 32 MiB L3.
STAGING_BLOCK_BYTES = 4 << 20


def row_kernel_name() -> str:
    """Which kernel `copy_rows_cpu` uses in this process, for the start-up report and stats
    (builds the native kernel if nothing asked for it yet)."""
    kernel = native.load()
    if kernel is not None:
        return kernel.name
    return f"numpy (no native kernel: {native.why_not()})"


def copy_rows_cpu(
    src: torch.Tensor,
    src_rows: Rows,
    dst: torch.Tensor,
    dst_rows: Rows,
    staging: torch.Tensor,
    *,
    use_native: bool = True,
) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] for every i; views are `[pages, row_bytes]` uint8.

    Rows are checked first (`check_row_pair`), before anything is written. A packed run to a
    packed run is one memcpy; everything else is one call of the native kernel when it is
    loaded (`use_native=False` forces the numpy kernels: tests, benchmarks), else
    `copy_rows_numpy`. Each is one call into C that releases the GIL for the whole copy (the
    numpy kernel for two index sets, one per block): the engine's forward pass and the
    scheduler's loop keep running while pages move.
    """
    if not check_row_pair(src, src_rows, dst, dst_rows):
        return
    if src_rows.is_run and dst_rows.is_run and src.is_contiguous() and dst.is_contiguous():
        _copy_run(src_rows.slice(src), dst_rows.slice(dst))
        return
    kernel = native.load() if use_native else None
    if kernel is None:
        _copy_rows_numpy(src, src_rows, dst, dst_rows, staging)
        return
    dst_index, src_index = _c_index(dst_rows), _c_index(src_rows)  # alive through the call
    kernel.copy(
        dst.data_ptr(),
        dst.stride(0),
        None if dst_index is None else dst_index.data_ptr(),
        dst_rows.start or 0,
        src.data_ptr(),
        src.stride(0),
        None if src_index is None else src_index.data_ptr(),
        src_rows.start or 0,
        src_rows.count,
        src.shape[1],
        store_mode(kernel, src_rows.count * src.shape[1], src.shape[1]),
    )


# Streaming (non-temporal) stores skip the read of each destination line before it is
# written. Whether that wins depends on the machine: on one 2-vCPU VM they were level or
# behind memcpy in most columns (docs/design.md, "CPU row kernels"); on another (AMD EPYC,
# AVX2) a 256 MiB load in 16 MiB calls of 256 KiB rows took 0.70 of memcpy's time. So a
# process measures once, on its first large copy, and streams large copies only where they
# win by a margin. Small copies always use cached stores: the engine reads what it loaded
# while it is still in cache.
STREAM_MIN_CALL_BYTES = 8 << 20  # a call moving less never streams
STREAM_MIN_ROW_BYTES = 16 << 10  # rows below this take the AVX2 loop (mode 0) regardless
STREAM_WINS_BELOW = 0.9  # streaming is chosen when it takes at most this share of the time
_CALIBRATION_ROW_BYTES = 256 << 10
_CALIBRATION_ROWS = 192  # 48 MiB a side: past a 32 MiB L3, as the copies it decides are
_store_lock = threading.Lock()
# streaming's time over cached stores', measured once per process (None: not yet)
_stream_ratio: float | None = None


def store_mode(kernel: native.NativeKernel, call_bytes: int, row_bytes: int) -> int:
    """The kernel mode for one call: 1 (streaming stores) for a large copy of large rows
    where this machine measured them faster, else 0 (AVX2 loop below 16 KiB, memcpy above)."""
    if call_bytes < STREAM_MIN_CALL_BYTES or row_bytes < STREAM_MIN_ROW_BYTES:
        return 0
    if not kernel.has_stream:
        return 0
    ratio = _stream_ratio if _stream_ratio is not None else _measure_stores(kernel)
    return 1 if ratio <= STREAM_WINS_BELOW else 0


def _measure_stores(kernel: native.NativeKernel) -> float:
    """Time cached and streaming stores on the same scattered rows (three alternating
    trials each, the fastest of each kept); returns streaming's share of the time, kept for
    the process."""
    global _stream_ratio
    with _store_lock:
        if _stream_ratio is not None:
            return _stream_ratio
        rows, row = _CALIBRATION_ROWS, _CALIBRATION_ROW_BYTES
        src = torch.ones(rows, row, dtype=torch.uint8)
        dst = torch.zeros(rows, row, dtype=torch.uint8)
        # a fixed scatter, as a load into an engine's churned blocks lands
        index = torch.tensor([(i * 77) % rows for i in range(rows)], dtype=torch.int64)

        def timed(mode: int) -> float:
            started = time.perf_counter()
            kernel.copy(
                dst.data_ptr(), row, index.data_ptr(), 0,
                src.data_ptr(), row, None, 0, rows, row, mode,
            )  # fmt: skip
            return time.perf_counter() - started

        best = {0: float("inf"), 1: float("inf")}
        for _ in range(3):
            for mode in best:
                best[mode] = min(best[mode], timed(mode))
        ratio = best[1] / best[0]
        streams = ratio <= STREAM_WINS_BELOW
        log.info(
            "row kernel: streaming stores took %.2f of cached stores' time on %d MiB; copies "
            "of %d MiB or more %s",
            ratio, rows * row >> 20, STREAM_MIN_CALL_BYTES >> 20,
            "stream their stores" if streams else "keep cached stores",
        )  # fmt: skip
        _stream_ratio = ratio
        return ratio


def large_copy_stores() -> str:
    """What large CPU copies use in this process: "streaming", "cached", or "not measured"
    (no large copy yet), with the measured ratio."""
    if _stream_ratio is None:
        return "not measured"
    kind = "streaming" if _stream_ratio <= STREAM_WINS_BELOW else "cached"
    return f"{kind} (streaming took {_stream_ratio:.2f} of cached stores' time)"


def _c_index(rows: Rows) -> torch.Tensor | None:
    """A set's index as the C loop reads it (packed int64 on the CPU), or None for a run."""
    index = rows.index
    if index is None:
        return None
    if index.dtype != torch.int64 or index.device.type != "cpu" or not index.is_contiguous():
        index = index.to("cpu", torch.int64).contiguous()
    return index


def copy_rows_numpy(
    src: torch.Tensor,
    src_rows: Rows,
    dst: torch.Tensor,
    dst_rows: Rows,
    staging: torch.Tensor,
    block_bytes: int = STAGING_BLOCK_BYTES,
) -> None:
    """`copy_rows_cpu` without the native kernel (checked the same way)."""
    if check_row_pair(src, src_rows, dst, dst_rows):
        _copy_rows_numpy(src, src_rows, dst, dst_rows, staging, block_bytes)


def _copy_rows_numpy(
    src: torch.Tensor,
    src_rows: Rows,
    dst: torch.Tensor,
    dst_rows: Rows,
    staging: torch.Tensor,
    block_bytes: int = STAGING_BLOCK_BYTES,
) -> None:
    """The numpy kernels (rows already checked): a run on both sides is one copy; a run on the
    destination is one gather (numpy `take` when both views are packed, torch `index_select`
    into strided rows); a run on the source is one numpy scatter. numpy always works on rows
    split into enough sub-items that it releases the GIL. Two index sets gather a block of
    rows into `staging` and scatter it, block by block."""
    if src_rows.is_run and dst_rows.is_run:  # one contiguous copy
        _copy_run(src_rows.slice(src), dst_rows.slice(dst))
        return
    if dst_rows.is_run:
        assert src_rows.index is not None
        _gather(src, src_rows.index, dst_rows.slice(dst))
        return
    assert dst_rows.index is not None
    if src_rows.is_run:
        _scatter(src_rows.slice(src), dst_rows.index, dst)
        return
    assert src_rows.index is not None
    row_bytes = src.shape[1]
    per_round = min(staging.numel(), max(block_bytes, row_bytes)) // row_bytes
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
