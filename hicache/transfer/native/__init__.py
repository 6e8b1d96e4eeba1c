"""The native row-copy kernel (`rowcopy.c`): built with the system C compiler on first use,
cached per user, loaded with ctypes.

One C loop, `dst + d[i] * dst_stride <- src + s[i] * src_stride`, `row_bytes` each, where
either side may be an index array or a run: the copy between two index sets that numpy can
only do through a staging buffer runs at a gather's speed (benchmarks/row_kernels.py). ctypes
releases the GIL for the whole call, so other Python threads keep running while it copies.

Building: `$CC` (split like a shell word list) or the first of cc, gcc, clang on PATH, with
`-O2 -fPIC -shared`, into `$XDG_CACHE_HOME/hicache` (or `~/.cache/hicache`). The file name
holds the hash of the source and of the build command, and the platform, so an edited source
or another machine's cache is never loaded by mistake. It is compiled to a temporary name in
the same folder and renamed into place (atomic: a concurrent process sees the whole library
or none). The folder must be a real directory owned by this user and writable by nobody else,
and so must the library file; otherwise nothing is built or loaded there (someone else could
swap the code we would run).

When there is no compiler, the build fails, or the cache is unsafe, `load()` returns None,
logs one warning saying why, and rows.py uses its numpy kernels; `why_not()` keeps the
reason. Nothing here runs at import: a fresh install needs no compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("hicache.transfer")

SOURCE = Path(__file__).with_name("rowcopy.c")
FLAGS = ("-O2", "-fPIC", "-shared")
VERSION = 2  # hicache_rowcopy_version() of the source this module expects
_BUILD_TIMEOUT_S = 120

_c_i64 = ctypes.c_int64
_c_ptr = ctypes.c_void_p


@dataclass(frozen=True)
class NativeKernel:
    """The loaded library: `copy(...)` is `hicache_copy_rows` (see rowcopy.c)."""

    path: Path
    copy: Callable[..., int]
    has_stream: bool  # mode 1 streams its stores (else it is mode 2)
    has_avx2_loop: bool  # mode 0 copies rows under 16 KiB with AVX2 (else by memcpy)

    @property
    def name(self) -> str:
        rows = "AVX2 loop below 16 KiB rows, memcpy above" if self.has_avx2_loop else "memcpy"
        return f"native C ({self.path.name}: {rows})"


_lock = threading.Lock()
_loaded: NativeKernel | None = None
_why_not: str | None = None
_tried = False


def cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "hicache"


def compiler() -> list[str] | None:
    cc = os.environ.get("CC", "").strip()
    if cc:
        words = shlex.split(cc)
        return words if shutil.which(words[0]) else None
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def _unsafe(path: Path, kind: str) -> str | None:
    """Why `path` must not be trusted (None: it is safe): not ours, writable by others, or not
    the kind of file we expect (a symlink in its place included)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{kind} {path} cannot be inspected ({exc.strerror})"
    wanted = stat.S_ISDIR if kind == "cache folder" else stat.S_ISREG
    if not wanted(st.st_mode):
        return f"{kind} {path} is not a {'directory' if kind == 'cache folder' else 'file'}"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{kind} {path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{kind} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def library_path(folder: Path, cc: list[str]) -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(repr((cc, FLAGS)).encode())
    tag = f"{sys.platform}-{platform.machine() or 'unknown'}"
    return folder / f"rowcopy-{digest.hexdigest()[:16]}-{tag}.so"


def _build(cc: list[str], target: Path) -> str | None:
    """Compile into a temporary file beside `target`, then rename it into place; the reason on
    failure."""
    fd, tmp = tempfile.mkstemp(prefix=".rowcopy-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        try:
            done = subprocess.run(
                [*cc, *FLAGS, "-o", tmp, str(SOURCE)],
                capture_output=True,
                text=True,
                timeout=_BUILD_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"the build with {cc[0]} failed: {exc}"
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            return f"the build with {cc[0]} failed (exit {done.returncode}): {first}"
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(path: Path) -> NativeKernel:
    lib = ctypes.CDLL(str(path))  # CDLL (not PyDLL): every call releases the GIL
    if lib.hicache_rowcopy_version() != VERSION:
        raise OSError(f"{path.name} is version {lib.hicache_rowcopy_version()}, not {VERSION}")
    fn = lib.hicache_copy_rows
    fn.restype = ctypes.c_int
    fn.argtypes = [
        *(_c_ptr, _c_i64, _c_ptr, _c_i64),  # destination: base, stride, index or NULL, start
        *(_c_ptr, _c_i64, _c_ptr, _c_i64),  # source: the same
        _c_i64,  # rows
        _c_i64,  # bytes per row
        ctypes.c_int,  # store mode
    ]
    return NativeKernel(
        path,
        fn,
        bool(lib.hicache_rowcopy_has_stream()),
        bool(lib.hicache_rowcopy_has_avx2_loop()),
    )


def _self_test(kernel: NativeKernel) -> str | None:
    """A few rows, small and large, through each mode against Python's own copy (a broken
    compiler or an ABI mismatch shows here, not as wrong pages later)."""
    for row in (300, 20000):
        src = bytes(i * 7 % 251 for i in range(3 * row))
        for mode in (0, 1, 2):
            dst = ctypes.create_string_buffer(len(src))
            index = (ctypes.c_int64 * 3)(2, 0, 1)
            base = ctypes.cast(ctypes.c_char_p(src), ctypes.c_void_p).value
            kernel.copy(ctypes.addressof(dst), row, index, 0, base, row, None, 0, 3, row, mode)
            if dst.raw != src[row:] + src[:row]:  # dst[2], dst[0], dst[1] = src[0], src[1], src[2]
                return f"{kernel.path.name} failed its self-test (mode {mode}, {row}-byte rows)"
    return None


def try_load(folder: Path | None = None) -> tuple[NativeKernel | None, str | None]:
    """Build (if needed) and load the kernel from `folder` (default `cache_dir()`): the kernel,
    or None and the reason. No logging, no caching: `load()` does both."""
    if os.name != "posix":
        return None, "the native kernel is built on POSIX systems only"
    try:
        folder = folder or cache_dir()
    except (RuntimeError, KeyError) as exc:  # no home folder to be found
        return None, f"no cache folder: {exc}"
    cc = compiler()
    if cc is None:
        return None, "no C compiler found ($CC, cc, gcc or clang on PATH)"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        return None, f"cache folder {folder} cannot be made ({exc.strerror})"
    reason = _unsafe(folder, "cache folder")
    if reason:
        return None, reason
    target = library_path(folder, cc)
    if not os.path.lexists(target):
        reason = _build(cc, target)
        if reason:
            return None, reason
    reason = _unsafe(target, "library")
    if reason:
        return None, reason
    try:
        kernel = _open(target)
    except (OSError, AttributeError) as exc:
        return None, f"{target.name} cannot be loaded: {exc}"
    reason = _self_test(kernel)
    return (None, reason) if reason else (kernel, None)


def load() -> NativeKernel | None:
    """The process's kernel, built and loaded once (thread-safe); None, after one warning
    naming why, where it cannot be had."""
    global _loaded, _why_not, _tried
    if _tried:
        return _loaded
    with _lock:
        if not _tried:
            _loaded, _why_not = try_load()
            if _loaded is None:
                log.warning("native row-copy kernel unavailable, using numpy: %s", _why_not)
            _tried = True
    return _loaded


def why_not() -> str | None:
    """Why `load()` found no kernel (None: it has one, or has not been asked yet)."""
    return _why_not
