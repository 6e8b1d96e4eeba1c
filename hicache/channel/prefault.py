"""Page tables filled before the hot path: the pages of a shared mapping faulted in once, when
it is made, never by the first copy that touches them.

A new mapping of a memfd has no page-table entries, so the first touch of each 4 KiB page
through it faults — once per page for writes (reads fault 16 pages at a time) — and a page
nobody wrote yet is allocated and zeroed on that fault as well. Measured on a 2-vCPU VM,
writing 256 MiB through a fresh mapping of pages that exist took 0.167 s with 65,536 faults,
through a populated one 0.030 s; a load into vLLM's blocks paid that on every block the
sidecar had not written before (docs/design.md, "Page tables ahead of the hot path").

Two users, one rule each:
- the ENGINE allocates its KV memory before it registers it (`populate(..., write=True)`:
  holes become zeroed pages, mapped writable here), as an engine's own allocator does when
  it zeroes its cache (vLLM's `torch.zeros`): the memory was the engine's already;
- the SIDECAR, once it mapped an engine's memfd, fills its own page tables for the pages the
  engine allocated (`allocated_extents`, `populate(..., write=False)`: a read populate maps
  shmem pages writable and faults 16 at a time), in a thread, without allocating anything
  the engine did not (a staging pool's untouched pages still cost nothing).

Nothing here changes a byte: a write populate faults as a write would, and writes nothing.
Where the kernel lacks `MADV_POPULATE_*` (before Linux 5.14), one byte of each page is read
instead, which faults it in the same way. `populate` works in chunks and checks `stop`
between them, so a session that ends waits for one chunk at most."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading

import numpy as np

MADV_POPULATE_READ = 22  # Linux 5.14
MADV_POPULATE_WRITE = 23
CHUNK_BYTES = 64 << 20  # between two looks at `stop`
PAGE_BYTES = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


MAX_EXTENTS = 4096  # looked for on the sidecar's event loop: a scattered file is cut short


def allocated_extents(
    fd: int, nbytes: int, max_extents: int = MAX_EXTENTS
) -> list[tuple[int, int]]:
    """The byte ranges [start, end) of a shmem file that hold pages (SEEK_DATA / SEEK_HOLE;
    a page allocated but never written, e.g. by fallocate, counts as a hole), in order; at
    most `max_extents` of them (an engine's pool is one or a few; pages past the last range
    returned fault as they are first copied)."""
    extents: list[tuple[int, int]] = []
    offset = 0
    while offset < nbytes and len(extents) < max_extents:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data past offset
                break
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), nbytes)
        if start >= end:
            break
        extents.append((start, end))
        offset = end
    return extents


def populate(
    address: int,
    nbytes: int,
    *,
    write: bool,
    stop: threading.Event | None = None,
) -> int:
    """Fault in the pages of [address, address + nbytes) of this process's mapping (whole
    pages; `address` page-aligned). Returns the bytes done: less than `nbytes` only when
    `stop` was set. Raises OSError from madvise for anything but an old kernel's EINVAL."""
    if address % PAGE_BYTES:
        raise ValueError(f"populate: address {address:#x} is not {PAGE_BYTES}-byte aligned")
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    done = 0
    while done < nbytes:
        if stop is not None and stop.is_set():
            break
        size = min(CHUNK_BYTES, nbytes - done)
        if _libc.madvise(address + done, size, advice) != 0:
            code = ctypes.get_errno()
            if code != errno.EINVAL:
                raise OSError(code, f"madvise(MADV_POPULATE_*): {os.strerror(code)}")
            _touch(address + done, size)  # a kernel before 5.14
        done += size
    return done


def _touch(address: int, nbytes: int) -> None:
    """Read one byte of every page (the fallback of a kernel without MADV_POPULATE_*)."""
    pages = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
    int(pages[::PAGE_BYTES].max())
