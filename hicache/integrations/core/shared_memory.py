"""An engine's own CPU memory shared with the sidecar in place: no staging, one copy per page.

The sidecar maps only sealed memfds (a truncated shared file would SIGBUS it). An engine's
buffers — SGLang's HiCache host pool (an mmap), SGLang's per-layer KV tensors (`torch.zeros`,
glibc's mmapped chunks), `/dev/zero` or an unsealed memfd of its own — are none of those.
`share_in_place(storages, what)` backs the pages under one or several allocations with one
sealed memfd without moving them: each allocation's pages get their place in the memfd, their
current bytes are copied in, and the memfd is mapped over the same addresses (`MAP_FIXED`),
chunk by chunk. Every tensor the engine holds keeps its address and now reads and writes the
memfd; when the engine frees the buffer, its munmap takes the shared pages with it.
`SharedRegions.offset_of(ptr)` is where an address of the shared memory lies in the memfd:
what a pool manifest's offsets are.

Only pages an allocation owns alone are remapped: a page-aligned allocation's own pages
(rounded up to whole pages), or glibc's mmapped chunk around an unaligned one (its header says
where it starts and ends; `malloc` must be glibc's). Every page must lie in read-write mappings
that are anonymous, the `/dev/zero` of a shared anonymous mmap, or a memfd — never a file,
never hugetlb (its pages cannot be replaced by 4 KiB ones). Anything else (a heap allocation
sharing its edge pages, another allocator preloaded, a file mapping, GPU memory) raises
`SharedMemoryError` naming the buffer (`what`) and the reason, and nothing is remapped.
`reach` narrows an allocation to the addresses its tensors use: only the whole pages under
them are remapped, so the memfd ends where the tensors do (a pool manifest may not leave the
sidecar mapping slack past its last row).

Users: the SGLang storage backend (its host pool, one allocation), the SGLang linker (its
device pools' allocations, per layer and K/V, and the Mamba pool's, all under one memfd; it
rebacks them together instead when this refuses) and the vLLM connector (`vllm/shared_kv.py`:
vLLM's one KV allocation, reached by its blocks' rows; it stages instead when this refuses).

Lifecycle (once per buffer, before the engine computes; again on an already shared one is
fine: its memfd is replaced):
    shared = share_in_place([t.untyped_storage() for t in buffers], what)   # or refused
    offset = shared.offset_of(tensor.data_ptr())   # -> SharedPools offsets over shared.fd
    ... the engine runs; the sidecar maps a dup of shared.fd ...
    shared.close()                                  # the descriptor; the mapping stays
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from hicache.channel.prefault import populate
from hicache.channel.shm import sealed_memfd
from hicache.errors import HicacheError

PAGE_BYTES = mmap.PAGESIZE
CHUNK_BYTES = 64 << 20  # remapped at a time: the copy's extra memory at most this
_IS_MMAPPED = 0x2  # glibc's chunk flag
_MAP_FIXED = 0x10  # Linux (Python's mmap module does not name it)
_MAX_SLACK_BYTES = 4 << 20  # glibc's alignment slop around an mmapped chunk, generously

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
    """The engine's memory cannot be shared in place (the message says which buffer, why)."""


class Storage(Protocol):
    """What `share_in_place` needs of an allocation (a torch `UntypedStorage` has it)."""

    def data_ptr(self) -> int: ...

    def nbytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Region:
    """Bytes [base, base + nbytes) of the engine's memory, at `offset` in the memfd."""

    base: int
    offset: int
    nbytes: int


@dataclass
class SharedRegions:
    """The engine's memory now backed by the memfd `fd` (`nbytes` long), region by region."""

    fd: int
    nbytes: int
    regions: tuple[Region, ...]

    def offset_of(self, address: int) -> int:
        """The memfd offset of an address inside one of the regions."""
        for region in self.regions:
            if region.base <= address < region.base + region.nbytes:
                return region.offset + address - region.base
        raise SharedMemoryError(
            f"address {address:#x} is in none of the {len(self.regions)} shared regions"
        )

    def buffer(self) -> torch.Tensor:
        """The memfd's bytes as a uint8 tensor over the engine's own memory (a view; never
        owns it): one region only, the memfd then being contiguous there."""
        if len(self.regions) != 1:
            raise SharedMemoryError(
                f"the memfd backs {len(self.regions)} separate regions; only one region's "
                "memory is one buffer"
            )
        array = (ctypes.c_uint8 * self.nbytes).from_address(self.regions[0].base)
        return torch.frombuffer(array, dtype=torch.uint8)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _mapping_path(address: int) -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


def owned_region(ptr: int, nbytes: int, what: str) -> tuple[int, int]:
    """Whole pages [start, end) that belong to the allocation [ptr, ptr + nbytes) alone: a
    page-aligned one's pages (the last rounded up: the mapping check says whose it is), or
    glibc's mmapped chunk around an unaligned one."""
    if ptr % PAGE_BYTES == 0:
        return ptr, -(-(ptr + nbytes) // PAGE_BYTES) * PAGE_BYTES
    malloc_in = _mapping_path(ctypes.cast(_libc.malloc, ctypes.c_void_p).value or 0)
    if "libc.so" not in malloc_in:
        raise SharedMemoryError(
            f"{what} at {ptr:#x} ({nbytes} bytes) is not page-aligned and malloc is not "
            f"glibc's (it lives in {malloc_in or 'an unknown mapping'}): which pages it owns "
            "alone is unknown"
        )
    prev_size, size = (ctypes.c_size_t * 2).from_address(ptr - 16)
    chunk = ptr - 16
    start, end = chunk - prev_size, chunk + (size & ~0x7)
    if (
        not size & _IS_MMAPPED
        or start % PAGE_BYTES
        or end % PAGE_BYTES
        or not start <= ptr < ptr + nbytes <= end
        or ptr - start > _MAX_SLACK_BYTES
        or end - ptr - nbytes > _MAX_SLACK_BYTES
    ):
        raise SharedMemoryError(
            f"{what} at {ptr:#x} ({nbytes} bytes) is not page-aligned nor one glibc mmapped "
            "chunk of its own; its edge pages may hold other allocations"
        )
    return start, end


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


def plan_regions(
    storages: Sequence[Storage],
    what: str = "the KV memory",
    reach: Sequence[tuple[int, int]] | None = None,
) -> tuple[Region, ...]:
    """Each distinct allocation's pages and their place in one memfd; every check made before
    anything is remapped. `reach`: per storage, the addresses [lo, hi) its tensors use; only
    the whole pages under them are remapped (the memfd then ends where the tensors do, as a
    pool manifest must: no slack), else all the allocation's own pages. Refused
    (SharedMemoryError) when none is given, or one is empty, not CPU memory, reached outside
    itself, or cannot be shared alone."""
    if not storages:
        raise SharedMemoryError(f"no allocation of {what} to share")
    if reach is not None and len(reach) != len(storages):
        raise SharedMemoryError(
            f"{what}: {len(reach)} reaches given for {len(storages)} allocations; one each"
        )
    used: dict[int, tuple[int, int, int]] = {}  # ptr -> nbytes, lo, hi
    for index, storage in enumerate(storages):
        device = getattr(storage, "device", None)
        if device is not None and torch.device(device).type != "cpu":
            raise SharedMemoryError(f"{what} is on {device}; in-place sharing is for CPU memory")
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes <= 0:
            raise SharedMemoryError(f"{what}: the allocation at {ptr:#x} is empty ({nbytes} bytes)")
        lo, hi = (ptr, ptr + nbytes) if reach is None else reach[index]
        if not ptr <= lo < hi <= ptr + nbytes:
            raise SharedMemoryError(
                f"{what}: its tensors reach {lo:#x}..{hi:#x}, outside their allocation "
                f"{ptr:#x}..{ptr + nbytes:#x}"
            )
        if ptr in used:
            _, was_lo, was_hi = used[ptr]
            lo, hi = min(lo, was_lo), max(hi, was_hi)
        used[ptr] = (nbytes, lo, hi)
    spans: set[tuple[int, int]] = set()
    for ptr, (nbytes, lo, hi) in used.items():
        own_start, own_end = owned_region(ptr, nbytes, what)
        start = max(own_start, lo - lo % PAGE_BYTES)
        end = min(own_end, -(-hi // PAGE_BYTES) * PAGE_BYTES)
        check_replaceable(start, end, what)
        spans.add((start, end))
    ordered = sorted(spans)
    for (_, end), (start, _) in itertools.pairwise(ordered):
        if start < end:
            raise SharedMemoryError(
                f"{what}: two allocations share pages around {start:#x}; each must own its pages"
            )
    regions, offset = [], 0
    for start, end in ordered:
        regions.append(Region(start, offset, end - start))
        offset += end - start
    return tuple(regions)


def share_in_place(
    storages: Sequence[Storage],
    what: str,
    name: str = "hicache-engine-kv",
    reach: Sequence[tuple[int, int]] | None = None,
) -> SharedRegions:
    """Back the pages under every allocation (or the part of it `reach` names: see
    `plan_regions`) with one sealed memfd (`name`), in place; `what` names the memory in
    errors. Nothing else may write it meanwhile (the engine calls this before it computes,
    or while it registers the buffer)."""
    regions = plan_regions(storages, what, reach)
    nbytes = sum(r.nbytes for r in regions)
    fd = sealed_memfd(name, nbytes)
    rw, shared = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED
    staging = _libc.mmap(None, nbytes, rw, shared, fd, 0)
    if staging in (None, _MAP_FAILED):
        os.close(fd)
        raise SharedMemoryError(
            f"mapping a {nbytes}-byte memfd for {what} failed: {os.strerror(ctypes.get_errno())}"
        )
    try:
        for region in regions:
            _remap(region, fd, staging, what)
    except BaseException:
        os.close(fd)
        raise
    finally:
        _libc.munmap(staging, nbytes)
    return SharedRegions(fd, nbytes, regions)


def _remap(region: Region, fd: int, staging: int, what: str) -> None:
    rw, shared = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED
    for done in range(0, region.nbytes, CHUNK_BYTES):
        size = min(CHUNK_BYTES, region.nbytes - done)
        address, offset = region.base + done, region.offset + done
        words = np.ctypeslib.as_array((ctypes.c_uint64 * (size // 8)).from_address(address))
        if words.any():  # a zero chunk needs no copy: the memfd's pages start zeroed
            ctypes.memmove(staging + offset, address, size)
        got = _libc.mmap(address, size, rw, shared | _MAP_FIXED, fd, offset)
        if got != address:  # pragma: no cover - the kernel refused a fixed mapping
            raise SharedMemoryError(
                f"remapping {size} bytes of {what} at {address:#x} failed: "
                f"{os.strerror(ctypes.get_errno())}; the memory is now partly shared"
            )
        # the engine's memory was resident: so is its memfd now, and the sidecar prefaults
        # the same pages when it maps them
        populate(address, size, write=True)
