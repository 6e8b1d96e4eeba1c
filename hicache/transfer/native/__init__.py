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
or none).

Trust (`_untrusted_path`, `_unsafe_file`): someone who can rename or replace any folder on the
way to the library can swap the code we would run, so every folder looked up to reach it is
checked, from `/` down, symlinks followed as the kernel follows them (the folder holding a link
is checked before the link is read, then the folders of its target): each must be owned by
root or by this user and writable by no one else — but for a sticky folder owned by root
(`/tmp`: others may add entries there, not rename or remove ours), where the entry we look up
in it must be ours or root's. The cache folder itself must be a real directory (no symlink)
owned by this user, mode without group/other write; so must the library file. Nothing is
built or loaded where any check fails. The library is then opened once, `O_NOFOLLOW`, its
descriptor checked with `fstat`, and that same file loaded by descriptor
(`/proc/self/fd/N`, `/dev/fd/N` where there is no /proc): no second lookup by name.

When there is no compiler, the build fails, or the cache is unsafe, `load()` returns None,
logs one warning saying why, and rows.py uses its numpy kernels; `why_not()` keeps the
reason. Nothing here runs at import: a fresh install needs no compiler.
"""

from __future__ import annotations

import ctypes
import errno
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


def _mode(st: os.stat_result) -> str:
    return f"uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"


def _writable_by_others(st: os.stat_result) -> bool:
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _unsafe_stat(st: os.stat_result, path: Path | str, kind: str) -> str | None:
    """Why a `kind` ("cache folder" or "library") with this stat must not be trusted (None:
    it is safe): not the kind of file expected (a symlink in its place included), not ours,
    or writable by others."""
    wanted = stat.S_ISDIR if kind == "cache folder" else stat.S_ISREG
    if not wanted(st.st_mode):
        return f"{kind} {path} is not a {'directory' if kind == 'cache folder' else 'file'}"
    if st.st_uid != os.getuid():
        return f"{kind} {path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    if _writable_by_others(st):
        return f"{kind} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _unsafe(path: Path, kind: str) -> str | None:
    """`_unsafe_stat` of `path` itself (not followed if it is a symlink)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{kind} {path} cannot be inspected ({exc.strerror})"
    return _unsafe_stat(st, path, kind)


_MAX_LINKS = 40  # as Linux's path lookup: a loop of symlinks ends here


def _untrusted_path(folder: Path) -> str | None:
    """Why the folders looked up to reach `folder` must not be trusted (None: they can be).
    Walks the absolute path from `/` as the kernel does, following symlinks: every folder an
    entry is looked up in must be owned by root or by this user and not writable by group or
    others — unless it is sticky and owned by root (`/tmp`), where the entry looked up (a
    folder or a symlink) must itself be owned by root or by this user. `folder` itself is
    looked up, not judged here (`_unsafe` does that: it must be ours, and no symlink)."""
    trusted_uids = {0, os.getuid()}
    pending = list((folder if folder.is_absolute() else Path.cwd() / folder).parts[1:])
    here, links = Path("/"), 0
    while pending:  # `here`: a folder with no symlink in its path, where `pending[0]` is next
        try:
            here_st = os.stat(here)
        except OSError as exc:
            return f"folder {here} cannot be inspected ({exc.strerror})"
        shared = False  # others may add entries here: the one we look up must be trusted
        if here_st.st_uid not in trusted_uids:
            return (
                f"folder {here} on the way to cache folder {folder} belongs to "
                f"{_mode(here_st)}: only root (0) or this user ({os.getuid()}) may own it"
            )
        if _writable_by_others(here_st):
            if not (here_st.st_mode & stat.S_ISVTX and here_st.st_uid == 0):
                return (
                    f"folder {here} on the way to cache folder {folder} is writable by group "
                    f"or others ({_mode(here_st)}): allowed only sticky and owned by root"
                )
            shared = True
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":  # `here` has no symlinks in it: its parent is its lexical parent
            here = here.parent
            continue
        entry = here / name
        try:
            st = os.lstat(entry)
            target = os.readlink(entry) if stat.S_ISLNK(st.st_mode) else ""
        except OSError as exc:
            return f"{entry} on the way to {folder} cannot be inspected ({exc.strerror})"
        if shared and st.st_uid not in trusted_uids:
            return (
                f"{entry} on the way to cache folder {folder}, in a folder others can write "
                f"to, belongs to {_mode(st)}: only root (0) or this user ({os.getuid()}) may own it"
            )
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                return f"more than {_MAX_LINKS} symlinks on the way to cache folder {folder}"
            pending[:0] = list(Path(target).parts)
            if os.path.isabs(target):
                pending.pop(0)  # the leading "/"
                here = Path("/")
            continue
        if not stat.S_ISDIR(st.st_mode):
            return f"{entry} on the way to cache folder {folder} is not a directory"
        here = entry
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


def _fd_path(fd: int) -> str:
    """A name the dynamic loader resolves to the open file `fd` itself."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


def _open_checked(path: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """Open the library once (`O_NOFOLLOW`), check that open file (`fstat`), and load it by its
    descriptor: what was checked is what runs, whatever the name points to meanwhile."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, f"library {path} is not a file"  # a symlink in its place
        return None, f"library {path} cannot be opened ({exc.strerror})"
    try:
        reason = _unsafe_stat(os.fstat(fd), path, "library")
        if reason:
            return None, reason
        try:
            return ctypes.CDLL(_fd_path(fd)), None  # CDLL (not PyDLL): calls release the GIL
        except OSError as exc:
            return None, f"{path.name} cannot be loaded: {exc}"
    finally:
        os.close(fd)  # the loader has mapped it: the descriptor is not needed any more


def _open(path: Path, lib: ctypes.CDLL) -> NativeKernel:
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
    reason = _untrusted_path(folder) or _unsafe(folder, "cache folder")
    if reason:
        return None, reason
    target = library_path(folder, cc)
    if not os.path.lexists(target):
        reason = _build(cc, target)
        if reason:
            return None, reason
    lib, reason = _open_checked(target)
    if lib is None:
        return None, reason
    try:
        kernel = _open(target, lib)
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
