"""The native row-copy kernel (`hicache/transfer/native`) and the numpy kernels it replaces:
every run / index-set combination, packed and strided (page_first) views, odd row widths,
1-byte rows, empty copies and rows larger than any staging block, against a row-by-row
reference; the GIL released during a long copy; the build refused in an unsafe cache folder,
and the fallback (with its one warning) when there is no compiler or the build fails.

Tests that need the native kernel skip, saying why, where it cannot be built (no compiler);
the numpy kernels are tested everywhere."""

from __future__ import annotations

import logging
import os
import random
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache.transfer import native
from hicache.transfer.rows import (
    STAGING_BLOCK_BYTES,
    Rows,
    copy_rows_cpu,
    copy_rows_numpy,
    row_kernel_name,
)

Copier = Callable[[torch.Tensor, Rows, torch.Tensor, Rows, torch.Tensor], None]


def native_or_skip() -> native.NativeKernel:
    kernel = native.load()
    if kernel is None:
        pytest.skip(f"no native row-copy kernel here: {native.why_not()}")
    return kernel


def copy_native(src: torch.Tensor, sr: Rows, dst: torch.Tensor, dr: Rows, st: torch.Tensor) -> None:
    native_or_skip()
    copy_rows_cpu(src, sr, dst, dr, st)


def copy_forced_numpy(
    src: torch.Tensor, sr: Rows, dst: torch.Tensor, dr: Rows, st: torch.Tensor
) -> None:
    copy_rows_cpu(src, sr, dst, dr, st, use_native=False)


def copy_numpy_small_blocks(
    src: torch.Tensor, sr: Rows, dst: torch.Tensor, dr: Rows, st: torch.Tensor
) -> None:
    copy_rows_numpy(src, sr, dst, dr, st, block_bytes=3 * src.shape[1])  # several blocks


COPIERS = {
    "native": copy_native,
    "numpy": copy_forced_numpy,
    "numpy_blocks": copy_numpy_small_blocks,
}


def rows_view(
    pages: int, row: int, seed: int, stride: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes as a `[pages, row]` view: packed, or `stride` bytes apart (page_first)."""
    gen = torch.Generator().manual_seed(seed)
    step = stride or row
    backing = torch.randint(0, 256, (pages * step + 5,), dtype=torch.uint8, generator=gen)
    return backing, backing[3:].as_strided((pages, row), (step, 1))  # odd offset: unaligned


def reference(
    src: torch.Tensor, s_ids: list[int], dst: torch.Tensor, d_ids: list[int]
) -> torch.Tensor:
    want = dst.clone()
    for s, d in zip(s_ids, d_ids, strict=True):
        want[d] = src[s]
    return want


@pytest.mark.parametrize("copier", list(COPIERS))
@pytest.mark.parametrize("row", [1, 7, 13, 64, 100, 2048 + 3, 16383, 16384])  # 16 KiB: memcpy
@pytest.mark.parametrize(
    ("src_run", "dst_run"), [(True, True), (False, True), (True, False), (False, False)]
)
@pytest.mark.parametrize(
    ("src_strided", "dst_strided"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_every_combination_copies_exactly_the_listed_rows(
    copier: str, row: int, src_run: bool, dst_run: bool, src_strided: bool, dst_strided: bool
) -> None:
    rng = random.Random(f"{row}{src_run}{dst_run}{src_strided}{dst_strided}")
    pages, count = 40, 17
    src_backing, src = rows_view(pages, row, 1, 3 * row + 5 if src_strided else None)
    dst_backing, dst = rows_view(pages, row, 2, 2 * row + 1 if dst_strided else None)
    s_ids = list(range(9, 9 + count)) if src_run else rng.sample(range(pages), count)
    d_ids = list(range(4, 4 + count)) if dst_run else rng.sample(range(pages), count)
    s_rows, d_rows = Rows.of(s_ids), Rows.of(d_ids)
    assert (s_rows.is_run, d_rows.is_run) == (src_run, dst_run)
    src_before, dst_backing_before = src_backing.clone(), dst_backing.clone()
    want = reference(src, s_ids, dst, d_ids)
    COPIERS[copier](src, s_rows, dst, d_rows, torch.empty(1 << 16, dtype=torch.uint8))
    assert torch.equal(dst, want)
    assert torch.equal(src_backing, src_before)
    written = torch.zeros_like(dst_backing, dtype=torch.bool)  # nothing outside dst's rows
    written[3:].as_strided(dst.shape, dst.stride())[d_ids] = True
    assert torch.equal(dst_backing[~written], dst_backing_before[~written])


@pytest.mark.parametrize("copier", list(COPIERS))
def test_an_empty_copy_writes_nothing(copier: str) -> None:
    _, src = rows_view(4, 16, 3, None)
    _, dst = rows_view(4, 16, 4, None)
    before = dst.clone()
    COPIERS[copier](src, Rows.of([]), dst, Rows.of([]), torch.empty(0, dtype=torch.uint8))
    assert torch.equal(dst, before)


@pytest.mark.parametrize("staging_rows", [0, 2])
@pytest.mark.parametrize("copier", list(COPIERS))
def test_rows_larger_than_any_block(copier: str, staging_rows: int) -> None:
    """A row larger than a staging block: one row per round through a staging buffer that
    holds it, row by row when the staging is smaller still."""
    row = STAGING_BLOCK_BYTES + 4096 + 7
    _, src = rows_view(5, row, 5, None)
    _, dst = rows_view(6, row, 6, 2 * row)
    want = reference(src, [4, 0, 2], dst, [5, 1, 3])
    staging = torch.empty(max(1 << 16, staging_rows * row), dtype=torch.uint8)
    COPIERS[copier](src, Rows.of([4, 0, 2]), dst, Rows.of([5, 1, 3]), staging)
    assert torch.equal(dst, want)


def test_index_tensors_of_another_dtype_or_layout_are_read_right() -> None:
    native_or_skip()
    _, src = rows_view(10, 24, 7, None)
    _, dst = rows_view(10, 24, 8, None)
    index = torch.tensor([0, 9, 0, 3, 0, 5], dtype=torch.int32)[1::2]  # [9, 3, 5], strided
    rows = Rows(3, None, index, 10)
    want = reference(src, [9, 3, 5], dst, [2, 7, 1])
    copy_rows_cpu(src, rows, dst, Rows.of([2, 7, 1]), torch.empty(0, dtype=torch.uint8))
    assert torch.equal(dst, want)


def test_bad_rows_are_refused_before_the_native_kernel_writes() -> None:
    native_or_skip()
    _, src = rows_view(8, 32, 9, None)
    _, dst = rows_view(8, 32, 10, None)
    before = dst.clone()
    with pytest.raises(ValueError, match=r"destination row 8 is outside the view.s rows 0\.\.7"):
        copy_rows_cpu(src, Rows.of([3, 1]), dst, Rows.of([5, 8]), torch.empty(0, dtype=torch.uint8))
    assert torch.equal(dst, before)


def running_during(copy: Callable[[], None]) -> tuple[float, float]:
    """(how long `copy` took on a worker thread, how long this thread's loop ran meanwhile):
    while a kernel holds the GIL this thread cannot run at all (but for the switch interval,
    set to 1 ms here, before the call starts); while it releases it, this thread runs
    whenever the OS gives it a core."""
    inside, finished = [False], threading.Event()
    call: list[float] = []

    def work() -> None:
        inside[0] = True
        call.append(time.perf_counter())
        copy()
        call.append(time.perf_counter())
        inside[0] = False
        finished.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        worker = threading.Thread(target=work)
        ran, last = 0.0, time.perf_counter()
        worker.start()
        while not finished.is_set():
            now = time.perf_counter()
            if inside[0] and now - last < 0.0005:  # ran from `last` to `now`, uninterrupted
                ran += now - last
            last = now
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    return call[1] - call[0], ran


@pytest.mark.parametrize("use_native", [True, False])
def test_other_threads_keep_running_during_a_long_copy(use_native: bool) -> None:
    if use_native:
        native_or_skip()
    row, pages, count = 8192, 8192, 16 * 8192  # 1 GiB in one call: rows repeat
    src = torch.ones(pages, row, dtype=torch.uint8)
    dst = torch.zeros(pages, row, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(11)
    s_rows = Rows(count, None, torch.randint(0, pages, (count,), generator=gen), pages)
    d_rows = Rows(count, None, torch.randint(0, pages, (count,), generator=gen), pages)
    staging = torch.empty(1 << 20, dtype=torch.uint8)

    def copy() -> None:
        copy_rows_cpu(src, s_rows, dst, d_rows, staging, use_native=use_native)

    took, ran = running_during(copy)
    assert took > 0.03, f"the copy took {took * 1e3:.1f} ms: too short to tell"
    # measured: a PyDLL build of the same kernel, which holds the GIL, lets it run 0-1 ms
    assert ran > took / 10, f"this thread ran {ran * 1e3:.1f} of {took * 1e3:.1f} ms"


def test_the_kernel_in_use_is_named() -> None:
    kernel = native.load()
    name = row_kernel_name()
    if kernel is None:
        assert name.startswith("numpy (no native kernel: ")
    else:
        assert name.startswith(f"native C ({kernel.path.name}: ")
        assert kernel.path.name.startswith("rowcopy-")
        assert kernel.path.suffix == ".so"


# ---- building and loading -------------------------------------------------------------


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """`native.load()` as in a new process (restored afterwards)."""
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_why_not", None)


def test_without_a_compiler_one_warning_and_the_numpy_kernels(
    monkeypatch: pytest.MonkeyPatch,
    fresh_state: None,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(native, "compiler", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached from earlier runs
    with caplog.at_level(logging.WARNING, logger="hicache.transfer"):
        assert native.load() is None
        assert native.load() is None
        assert (
            row_kernel_name()
            == "numpy (no native kernel: no C compiler found ($CC, cc, gcc or clang on PATH))"
        )
    warnings = [r for r in caplog.records if "native row-copy kernel" in r.getMessage()]
    assert len(warnings) == 1
    assert "no C compiler found" in warnings[0].getMessage()
    _, src = rows_view(9, 40, 12, None)
    _, dst = rows_view(9, 40, 13, 48)
    want = reference(src, [8, 1, 4], dst, [0, 7, 3])
    copy_rows_cpu(
        src, Rows.of([8, 1, 4]), dst, Rows.of([0, 7, 3]), torch.empty(100, dtype=torch.uint8)
    )
    assert torch.equal(dst, want)


def test_a_failed_build_is_reported_and_nothing_is_left(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    if native.compiler() is None:
        pytest.skip("no C compiler here")
    broken = tmp_path / "rowcopy.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    folder = tmp_path / "cache"
    kernel, why = native.try_load(folder)
    assert kernel is None
    assert why is not None
    assert "failed (exit" in why
    assert list(folder.iterdir()) == []  # the temporary file is gone


def test_a_build_lands_under_its_hash_and_is_reused(tmp_path: Path) -> None:
    if native.compiler() is None:
        pytest.skip("no C compiler here")
    folder = tmp_path / "cache"
    kernel, why = native.try_load(folder)
    assert kernel is not None, why
    (built,) = folder.iterdir()
    assert built == kernel.path
    assert built.name.endswith(f"-{os.uname().sysname.lower()}-{os.uname().machine}.so")
    assert folder.stat().st_mode & 0o077 == 0
    assert built.stat().st_mode & 0o022 == 0
    mtime = built.stat().st_mtime_ns
    again, _ = native.try_load(folder)
    assert again is not None
    assert built.stat().st_mtime_ns == mtime  # loaded, not rebuilt


def pretend_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that must never run: the refusals come before any build."""
    monkeypatch.setattr(native, "compiler", lambda: ["/nonexistent/cc"])


def test_a_cache_folder_writable_by_others_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pretend_compiler(monkeypatch)
    folder = tmp_path / "open_to_all"
    folder.mkdir()
    folder.chmod(0o777)
    kernel, why = native.try_load(folder)
    assert kernel is None
    assert why == f"cache folder {folder} is writable by group or others (mode 777)"
    assert list(folder.iterdir()) == []


def test_a_cache_folder_that_is_a_symlink_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pretend_compiler(monkeypatch)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    kernel, why = native.try_load(link)
    assert kernel is None
    assert why == f"cache folder {link} is not a directory"


def test_a_planted_library_writable_by_others_is_not_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pretend_compiler(monkeypatch)
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    planted = native.library_path(folder, ["/nonexistent/cc"])
    planted.write_bytes(b"not a library")
    planted.chmod(0o666)
    kernel, why = native.try_load(folder)
    assert kernel is None
    assert why == f"library {planted} is writable by group or others (mode 666)"


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to chown")
def test_a_cache_folder_of_another_user_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pretend_compiler(monkeypatch)
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, 12345, 12345)
    kernel, why = native.try_load(folder)
    assert kernel is None
    assert why == f"cache folder {folder} belongs to uid 12345, not to this user (0)"


def test_a_folder_above_the_cache_writable_by_others_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Whoever can write a folder above the cache can rename it away and put their own in its
    place: every folder on the way is checked, not only the cache folder."""
    pretend_compiler(monkeypatch)
    open_to_all = tmp_path / "open_to_all"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    folder = open_to_all / "mine" / "cache"
    folder.mkdir(mode=0o700, parents=True)
    (open_to_all / "mine").chmod(0o700)
    kernel, why = native.try_load(folder)
    assert kernel is None
    assert why == (
        f"folder {open_to_all} on the way to cache folder {folder} is writable by group or "
        f"others (uid {os.getuid()}, mode 777): allowed only sticky and owned by root"
    )
    assert list(folder.iterdir()) == []  # nothing built


def test_a_symlinked_folder_above_the_cache_is_checked_where_it_points(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pretend_compiler(monkeypatch)
    open_to_all = tmp_path / "open_to_all"
    (open_to_all / "real").mkdir(parents=True)
    open_to_all.chmod(0o777)
    link = tmp_path / "link"
    link.symlink_to(open_to_all / "real")
    folder = link / "cache"
    kernel, why = native.try_load(folder)
    assert kernel is None
    assert why is not None
    assert why.startswith(f"folder {open_to_all} on the way to cache folder {folder} is writable")


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root's folder")
def test_a_sticky_folder_of_root_above_the_cache_is_allowed(tmp_path: Path) -> None:
    """As /tmp: others can add entries there, but not rename or remove ours."""
    if native.compiler() is None:
        pytest.skip("no C compiler here")
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    kernel, why = native.try_load(sticky / "cache")
    assert kernel is not None, why


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to chown")
def test_a_folder_above_the_cache_of_another_user_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pretend_compiler(monkeypatch)
    theirs = tmp_path / "theirs"
    folder = theirs / "cache"
    folder.mkdir(mode=0o700, parents=True)
    theirs.chmod(0o755)
    os.chown(theirs, 12345, 12345)
    kernel, why = native.try_load(folder)
    assert kernel is None
    assert why == (
        f"folder {theirs} on the way to cache folder {folder} belongs to uid 12345, mode 755: "
        "only root (0) or this user (0) may own it"
    )


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to chown")
def test_a_symlink_of_another_user_in_a_sticky_folder_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In a sticky folder the owner of an entry may replace it: a link someone else owns there
    could be pointed elsewhere."""
    pretend_compiler(monkeypatch)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = sticky / "link"
    link.symlink_to(real)
    os.lchown(link, 12345, 12345)
    folder = link / "cache"
    kernel, why = native.try_load(folder)
    assert kernel is None
    assert why == (
        f"{link} on the way to cache folder {folder}, in a folder others can write to, belongs "
        f"to uid 12345, mode {stat.S_IMODE(os.lstat(link).st_mode):o}: only root (0) or this "
        "user (0) may own it"
    )


def test_the_library_checked_is_the_one_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The library is opened once and loaded by its descriptor: a file put in its place after
    the checks (by name) is not what runs."""
    if native.compiler() is None:
        pytest.skip("no C compiler here")
    folder = tmp_path / "cache"
    built, why = native.try_load(folder)
    assert built is not None, why
    target = built.path
    opened: list[str] = []
    real_cdll = native.ctypes.CDLL

    def swap_then_load(name: str, *args: object, **kwargs: object) -> object:
        opened.append(name)
        target.unlink()  # after the checks: someone swaps the file at that name
        target.write_bytes(b"not a library")
        return real_cdll(name, *args, **kwargs)

    monkeypatch.setattr(native.ctypes, "CDLL", swap_then_load)
    kernel, why = native.try_load(folder)
    assert kernel is not None, why  # the file that was checked, loaded through its descriptor
    assert opened
    assert opened[0].startswith(("/proc/self/fd/", "/dev/fd/"))


def test_a_library_that_is_a_symlink_is_not_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pretend_compiler(monkeypatch)
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere.so"
    elsewhere.write_bytes(b"not a library")
    elsewhere.chmod(0o700)
    planted = native.library_path(folder, ["/nonexistent/cc"])
    planted.symlink_to(elsewhere)
    kernel, why = native.try_load(folder)
    assert kernel is None
    assert why == f"library {planted} is not a file"


def test_a_refused_cache_is_named_where_the_row_kernel_is_reported(
    monkeypatch: pytest.MonkeyPatch, fresh_state: None, tmp_path: Path
) -> None:
    pretend_compiler(monkeypatch)
    open_to_all = tmp_path / "open_to_all"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(open_to_all))
    assert native.load() is None
    name = row_kernel_name()
    assert name.startswith(f"numpy (no native kernel: folder {open_to_all} on the way to ")
    assert "allowed only sticky and owned by root" in name


@pytest.mark.parametrize("streams", [False, True])
def test_a_large_scattered_copy_is_exact_with_either_store_kind(
    monkeypatch: pytest.MonkeyPatch, streams: bool
) -> None:
    """A copy of 8 MiB or more of large rows takes the store kind this process measured
    (`rows.store_mode`); both kinds copy exactly the listed rows, and a small copy never
    streams whatever was measured."""
    from hicache.transfer import rows as rows_mod

    kernel = native_or_skip()
    monkeypatch.setattr(rows_mod, "_stream_ratio", 0.5 if streams else 1.0)
    row = 64 << 10
    count = rows_mod.STREAM_MIN_CALL_BYTES // row + 3  # odd rows past the threshold
    gen = torch.Generator().manual_seed(7)
    src = torch.randint(0, 256, (count, row), dtype=torch.uint8, generator=gen)
    dst = torch.zeros(2 * count, row, dtype=torch.uint8)
    order = list(range(2 * count))
    random.Random(3).shuffle(order)
    targets = order[:count]
    assert rows_mod.store_mode(kernel, count * row, row) == (1 if streams else 0)
    assert rows_mod.store_mode(kernel, 4 * row, row) == 0
    assert rows_mod.store_mode(kernel, 1 << 30, 4096) == 0  # small rows: the AVX2 loop
    copy_rows_cpu(src, Rows.of(range(count)), dst, Rows.of(targets), torch.empty(0))
    for i, t in enumerate(targets):
        assert torch.equal(dst[t], src[i]), f"row {i} -> {t}"
    untouched = sorted(set(range(2 * count)) - set(targets))
    assert int(dst[untouched].sum()) == 0


def test_the_store_kind_is_measured_once_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache.transfer import rows as rows_mod

    kernel = native_or_skip()
    monkeypatch.setattr(rows_mod, "_stream_ratio", None)
    assert rows_mod.large_copy_stores() == "not measured"
    ratio = rows_mod._measure_stores(kernel)
    assert ratio > 0
    assert rows_mod._stream_ratio == ratio
    assert rows_mod._measure_stores(kernel) == ratio  # kept: not measured again
    kind = "streaming" if ratio <= rows_mod.STREAM_WINS_BELOW else "cached"
    assert rows_mod.large_copy_stores() == (
        f"{kind} (streaming took {ratio:.2f} of cached stores' time)"
    )
