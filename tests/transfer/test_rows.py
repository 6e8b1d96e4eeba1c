"""`copy_rows_cpu` kernel by kernel: each case (run to run, packed and strided gathers and
scatters, scatters of rows split into sub-items, two index sets through staging, rows larger
than the staging) against a row-by-row reference, through the native kernel where it is
loaded and through the numpy kernels (`use_native=False`) everywhere, and the errors for bad
rows. The native kernel's own tests are in test_native_rows.py."""

from __future__ import annotations

import random

import pytest
import torch

from hicache.transfer.rows import Rows, copy_rows_cpu, split_for


def random_rows(pages: int, row_bytes: int, seed: int, stride_bytes: int | None = None):
    """A `[pages, row_bytes]` uint8 view of random bytes: packed, or strided as a page_first
    host pool is (each row `stride_bytes` after the last, the gaps holding other data)."""
    gen = torch.Generator().manual_seed(seed)
    step = stride_bytes or row_bytes
    backing = torch.randint(0, 256, (pages * step,), dtype=torch.uint8, generator=gen)
    return backing, backing.as_strided((pages, row_bytes), (step, 1))


def expected_after(
    src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]
) -> torch.Tensor:
    want = dst.clone()
    for s, d in zip(src_ids, dst_ids, strict=True):
        want[d] = src[s]
    return want


CASES = [
    # (name, row bytes, source strided?, destination strided?, source run?, destination run?)
    ("run to run", 64, False, False, True, True),
    ("packed gather", 64, False, False, False, True),
    ("packed scatter", 64, False, False, True, False),
    ("strided gather", 64, False, True, False, True),
    ("strided scatter", 64, True, False, True, False),
    ("packed scatter, few large rows split into sub-items", 4096, False, False, True, False),
    ("strided scatter, few large rows split into sub-items", 4096, True, False, True, False),
    ("two index sets, packed", 64, False, False, False, False),
    ("two index sets, strided", 64, True, True, False, False),
]


@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize(("name", "row", "src_strided", "dst_strided", "src_run", "dst_run"), CASES)
def test_each_kernel_copies_exactly_the_listed_rows(
    name: str,
    row: int,
    src_strided: bool,
    dst_strided: bool,
    src_run: bool,
    dst_run: bool,
    use_native: bool,
) -> None:
    rng = random.Random(name)
    pages, count = 12, 5
    src_backing, src = random_rows(pages, row, 1, 3 * row if src_strided else None)
    dst_backing, dst = random_rows(pages, row, 2, 2 * row if dst_strided else None)
    src_ids = list(range(4, 4 + count)) if src_run else rng.sample(range(pages), count)
    dst_ids = list(range(2, 2 + count)) if dst_run else rng.sample(range(pages), count)
    src_rows, dst_rows = Rows.of(src_ids), Rows.of(dst_ids)
    assert (src_rows.is_run, dst_rows.is_run) == (src_run, dst_run)
    src_before, dst_backing_before = src_backing.clone(), dst_backing.clone()
    want = expected_after(src, src_ids, dst, dst_ids)
    staging = torch.empty(3 * row, dtype=torch.uint8)  # smaller than the op: several rounds
    copy_rows_cpu(src, src_rows, dst, dst_rows, staging, use_native=use_native)
    assert torch.equal(dst, want)
    assert torch.equal(src_backing, src_before)  # the source is untouched
    if dst_strided:  # the gaps between strided rows (other layers' data) are untouched
        gaps = torch.ones_like(dst_backing, dtype=torch.bool)
        gaps.as_strided(dst.shape, dst.stride()).fill_(False)
        assert torch.equal(dst_backing[gaps], dst_backing_before[gaps])


@pytest.mark.parametrize("use_native", [True, False])
def test_rows_larger_than_the_staging_go_one_by_one(use_native: bool) -> None:
    _, src = random_rows(6, 256, 3)
    _, dst = random_rows(6, 256, 4)
    want = expected_after(src, [5, 0, 3], dst, [1, 4, 2])
    copy_rows_cpu(
        src,
        Rows.of([5, 0, 3]),
        dst,
        Rows.of([1, 4, 2]),
        torch.empty(100, dtype=torch.uint8),
        use_native=use_native,
    )
    assert torch.equal(dst, want)


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "message"),
    [
        ([0, 1], [3], "2 source rows but 1 destination rows"),
        ([0, 9], [3, 4], "source row 9 is outside the view's rows 0..7"),
        ([0, 1], [2, 8], "destination row 8 is outside the view's rows 0..7"),
        ([5, 6, 7, 8], [0, 1, 2, 3], "source row 8 is outside the view's rows 0..7"),
    ],
)
def test_bad_rows_are_refused_and_nothing_is_written(
    src_ids: list[int], dst_ids: list[int], message: str
) -> None:
    _, src = random_rows(8, 32, 5)
    _, dst = random_rows(8, 32, 6)
    before = dst.clone()
    with pytest.raises(ValueError, match=message):
        copy_rows_cpu(
            src, Rows.of(src_ids), dst, Rows.of(dst_ids), torch.empty(64, dtype=torch.uint8)
        )
    assert torch.equal(dst, before)


def test_row_widths_must_match() -> None:
    _, src = random_rows(4, 32, 7)
    _, dst = random_rows(4, 16, 8)
    with pytest.raises(ValueError, match="source rows of 32 bytes but destination rows of 16"):
        copy_rows_cpu(src, Rows.of([0]), dst, Rows.of([1]), torch.empty(64, dtype=torch.uint8))


def test_negative_rows_are_refused_when_the_set_is_built() -> None:
    with pytest.raises(ValueError, match="row -1 is negative"):
        Rows.of([3, -1])


def test_runs_and_index_sets() -> None:
    assert Rows.of([4, 5, 6]) == Rows(3, 4, None, 7)
    scattered = Rows.of([6, 4, 5])
    assert not scattered.is_run
    assert scattered.end == 7
    assert scattered.ids() == [6, 4, 5]
    assert Rows.of([]).count == 0
    assert Rows.of([]).end == 0


def test_rows_split_so_numpy_loops_over_more_than_500_items() -> None:
    # numpy releases the GIL only past 500 items: 64 rows of 128 KiB go as 512 of 16 KiB
    assert split_for(64, 128 * 2**10) == 8
    assert split_for(16, 512 * 2**10) == 32
    assert split_for(1000, 2048) == 1  # enough rows already
    assert split_for(5, 4096) == 16  # items stay >= 256 bytes
    assert split_for(5, 36) == 1  # a row that does not halve evenly stays whole


@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize("strided", [False, True])
def test_float_wide_items_copy_nan_payloads_and_denormals_bit_exact(
    strided: bool, use_native: bool
) -> None:
    """Rows move as float64 items where they can: every bit pattern must survive, signalling
    and quiet NaNs with payloads, infinities, denormals and negative zero included."""
    patterns = [
        0x7FF0000000000001,  # signalling NaN
        0x7FF8DEADBEEF0001,  # quiet NaN with a payload
        0xFFF0000000000000,  # -inf
        0x0000000000000001,  # the smallest denormal
        0x8000000000000000,  # -0.0
        0x000FFFFFFFFFFFFF,  # the largest denormal
        0x7FF7FFFFFFFFFFFF,  # signalling NaN, all payload bits
        0x0123456789ABCDEF,
    ]
    signed = [p - (1 << 64) if p >= 1 << 63 else p for p in patterns]
    row = torch.tensor(signed, dtype=torch.int64).view(torch.uint8)  # 64 bytes
    src = row.repeat(6).view(6, 64)
    backing = torch.zeros(8 * 128, dtype=torch.uint8)
    dst = backing.as_strided((8, 64), (128, 1)) if strided else backing[: 8 * 64].view(8, 64)
    copy_rows_cpu(
        src,
        Rows.of([4, 1, 0]),
        dst,
        Rows.of([2, 3, 4]),
        torch.empty(0, dtype=torch.uint8),
        use_native=use_native,
    )
    for d in (2, 3, 4):
        assert dst[d].view(torch.int64).tolist() == signed


def test_views_that_are_not_byte_rows_are_refused() -> None:
    _, dst = random_rows(4, 32, 9)
    columns = torch.zeros(32, 4, dtype=torch.uint8).t()  # a row's bytes are 4 apart
    with pytest.raises(ValueError, match=r"the source is a torch\.uint8 view of shape \(4, 32\)"):
        copy_rows_cpu(columns, Rows.of([0]), dst, Rows.of([1]), torch.empty(64, dtype=torch.uint8))
    floats = torch.zeros(4, 32)
    with pytest.raises(ValueError, match=r"the destination is a torch\.float32 view"):
        copy_rows_cpu(dst, Rows.of([0]), floats, Rows.of([1]), torch.empty(64, dtype=torch.uint8))
