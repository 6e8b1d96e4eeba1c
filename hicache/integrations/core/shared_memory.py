"""An engine's own host memory shared with the sidecar in place: no staging, one copy per page.

The sidecar maps only sealed memfds (a truncated shared file would SIGBUS it). An engine's
buffer — SGLang's HiCache host pool, an mmap of anonymous memory, `/dev/zero` or an unsealed
memfd of its own — is none of those. `share_in_place(tensor)` gives the pages under the
tensor's storage a sealed memfd without moving them: the memfd is sized, sealed, filled with
the current bytes, then mapped over the same addresses (`MAP_FIXED`), chunk by chunk. Every
tensor the engine holds keeps its address and now reads and writes the memfd; when the engine
frees the buffer, its munmap takes the shared pages with it.

Only memory that is safe to replace is taken: the storage must start on a page and every page
of it (rounded up to whole pages) must lie in read-write mappings that are anonymous, the
`/dev/zero` of a shared anonymous mmap, or a memfd — never a file, never hugetlb (its pages
cannot be replaced by 4 KiB ones). Anything else raises `SharedMemoryError` naming the mapping.
The vLLM connector's `vllm.shared_kv.share_in_place` does the same for glibc heap chunks; it
should move here when the connectors are merged into `integrations/vllm/`.

Lifecycle: share_in_place (once per buffer; again on an already shared one is fine: its
memfd is replaced) -> SharedRegion.fd registered with the sidecar (a dup per registration)
-> close() (the descriptor only: the mapping stays the engine's memory).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass

import numpy as np
import torch

from hicache.channel.prefault import populate
from hicache.channel.shm import sealed_memfd
from hicache.errors import HicacheError

PAGE_BYTES = mmap.PAGESIZE
CHUNK_BYTES = 64 << 20  # remapped at a time: the copy's extra memory at most this
_MAP_FIXED = 0x10  # Linux (Python's mmap module does not name it)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class SharedMemoryError(HicacheError):
    """The engine's buffer cannot be shared in place (the message says which mapping, why)."""


@dataclass
class SharedRegion:
    """The bytes [base, base + nbytes) now backed by the sealed memfd `fd` (byte 0 at base)."""

    fd: int
    base: int
    nbytes: int

    def buffer(self) -> torch.Tensor:
        """The region as a uint8 tensor (a view of the engine's memory; never owns it)."""
        array = (ctypes.c_uint8 * self.nbytes).from_address(self.base)
        return torch.frombuffer(array, dtype=torch.uint8)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _replaceable(path: str) -> bool:
    return path in ("", "/dev/zero (deleted)") or path.startswith("/memfd:")


def check_replaceable(start: int, end: int, what: str) -> None:
    """[start, end) lies whole in read-write mappings we may replace (see the module doc)."""
    covered = start
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if hi <= covered or lo >= end:
                continue
            path = fields[5].strip() if len(fields) > 5 else ""
            if lo > covered:
                break
            if not fields[1].startswith("rw") or not _replaceable(path) or "hugepage" in path:
                raise SharedMemoryError(
                    f"{what} at {start:#x}..{end:#x} lies in the mapping {line.strip()!r}; "
                    "only read-write anonymous, /dev/zero or memfd memory is shared in place"
                )
            covered = hi
            if covered >= end:
                return
    raise SharedMemoryError(f"{what} at {start:#x}..{end:#x} is not mapped whole")


def share_in_place(tensor: torch.Tensor, what: str) -> SharedRegion:
    """Back every page under `tensor`'s storage with a sealed memfd, in place; `what` names
    the buffer in errors."""
    if tensor.device.type != "cpu":
        raise SharedMemoryError(f"{what} is on {tensor.device}; in-place sharing is for CPU memory")
    storage = tensor.untyped_storage()
    start, size = storage.data_ptr(), storage.nbytes()
    if start % PAGE_BYTES or size == 0:
        raise SharedMemoryError(
            f"{what} starts at {start:#x} ({size} bytes), not on a {PAGE_BYTES}-byte page: it "
            "is not a buffer of its own (SGLang's host pools are mmaps)"
        )
    nbytes = -(-size // PAGE_BYTES) * PAGE_BYTES
    check_replaceable(start, start + nbytes, what)
    fd = sealed_memfd("hicache-engine-host", nbytes)
    rw, shared = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED
    staging = _libc.mmap(None, nbytes, rw, shared, fd, 0)
    if staging in (None, _MAP_FAILED):
        os.close(fd)
        raise SharedMemoryError(
            f"mapping a {nbytes}-byte memfd for {what} failed: {os.strerror(ctypes.get_errno())}"
        )
    try:
        for offset in range(0, nbytes, CHUNK_BYTES):
            chunk = min(CHUNK_BYTES, nbytes - offset)
            words = np.ctypeslib.as_array(
                (ctypes.c_uint64 * (chunk // 8)).from_address(start + offset)
            )
            if words.any():  # zero chunks need no copy: the memfd's pages start zeroed
                ctypes.memmove(staging + offset, start + offset, chunk)
            # nothing writes the buffer while the engine registers it: the copy and the
            # remap of a chunk see the same bytes
            got = _libc.mmap(start + offset, chunk, rw, shared | _MAP_FIXED, fd, offset)
            if got != start + offset:
                raise SharedMemoryError(  # pragma: no cover - the kernel refused a fixed map
                    f"remapping {chunk} bytes of {what} at {start + offset:#x} failed: "
                    f"{os.strerror(ctypes.get_errno())}; the buffer is now partly shared"
                )
            populate(start + offset, chunk, write=True)
    except BaseException:
        os.close(fd)
        raise
    finally:
        _libc.munmap(staging, nbytes)
    return SharedRegion(fd, start, nbytes)
