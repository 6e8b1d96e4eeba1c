"""vLLM's KV blocks as the pool the sidecar copies into: no staging, one copy per page.

CPU. vLLM allocates its KV cache as one private allocation (`torch.zeros`, every layer a
view); the sidecar can map only a sealed memfd. `share_in_place` gives the pages under
vLLM's blocks shared backing without moving them: a sealed memfd of the same size, the
current bytes copied in, then mapped over the same addresses (`MAP_FIXED`), chunk by chunk.
Every tensor vLLM holds keeps its address and now reads and writes the memfd. Only pages
this allocation owns are remapped: a page-aligned allocation's own pages, or glibc's mmapped
chunk around it (the header says where it starts and ends; `malloc` must be glibc's). When
the allocation is freed, glibc unmaps the region, shared pages and all. Anything else (an
allocator preloaded, memory another allocation shares) is refused with the reason, and the
connector falls back to its staging pool.

`blocks_pools` describes vLLM's blocks as hicache's pools over that memfd: per group, layer and
tensor the byte offset of block 0's part and the block stride (`page_strides`), so the
sidecar maps them as page rows (`hicache.channel.shm`), checks every row is in bounds, and its
copies land in vLLM's blocks. `blocks_device_pools` is the same for CUDA tensors, registered by
IPC handle (`register_cuda_pools`).

Isolation is the sidecar's usual: a session registers only memory of its own process, so a
buggy engine reaches only its own blocks; no L2 page is ever mapped into an engine.

Lifecycle (the worker, once, in `register_kv_caches`; `data_plane` chooses and does this):
    memory = share_in_place(bindings)                    # SharedKvError: use staging
    pools = blocks_pools(memory, bindings, geometries)   # a SharedPools of vLLM's blocks
    client.register_pools(pools)                         # page ids are vLLM's block ids
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hicache.channel.prefault import populate
from hicache.channel.shm import SharedPools, sealed_memfd
from hicache.client import Client
from hicache.errors import HicacheError
from hicache.integrations.vllm.binding import LayerBinding
from hicache.memory import DevicePool, GroupGeometry
from hicache.model import LayerMap

PAGE_BYTES = mmap.PAGESIZE
CHUNK_BYTES = 64 << 20  # remapped at a time: the copy's extra memory at most this
_IS_MMAPPED = 0x2  # glibc's chunk flag
_MAP_FIXED = 0x10  # Linux (Python's mmap module does not name it)
_MAX_SLACK_BYTES = 4 << 20  # glibc's alignment slop around an mmapped chunk, generously

log = logging.getLogger("hicache.vllm")
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


class SharedKvError(HicacheError):
    """vLLM's KV memory cannot be shared in place (the reason says why)."""


@dataclass
class SharedKv:
    """vLLM's KV bytes [base, base + nbytes) now backed by the memfd `fd` (byte 0 at base)."""

    fd: int
    base: int
    nbytes: int

    def buffer(self) -> torch.Tensor:
        """The region as a uint8 tensor (a view of vLLM's memory; never owns it)."""
        array = (ctypes.c_uint8 * self.nbytes).from_address(self.base)
        return torch.frombuffer(array, dtype=torch.uint8)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _extent(bindings: Mapping[int, LayerBinding]) -> tuple[int, int, torch.Tensor]:
    """The first and end byte any binding's rows reach, and the storage they share."""
    storages = {b.blocks.untyped_storage().data_ptr(): b.blocks for b in bindings.values()}
    if len(storages) != 1:
        raise SharedKvError(
            f"vLLM's KV tensors live in {len(storages)} allocations; sharing in place needs one"
        )
    lo = min(b.blocks.data_ptr() for b in bindings.values())
    hi = max(
        b.blocks.data_ptr() + (b.blocks.shape[0] - 1) * b.blocks.stride(0) + b.blocks.shape[1]
        for b in bindings.values()
    )
    return lo, hi, next(iter(storages.values()))


def _owned_region(ptr: int, nbytes: int) -> tuple[int, int]:
    """Whole pages [start, end) that belong to the allocation [ptr, ptr + nbytes) alone."""
    if ptr % PAGE_BYTES == 0 and nbytes % PAGE_BYTES == 0:
        return ptr, ptr + nbytes
    malloc_in = _mapping_path(ctypes.cast(_libc.malloc, ctypes.c_void_p).value or 0)
    if "libc.so" not in malloc_in:
        raise SharedKvError(
            f"the KV allocation at {ptr:#x} ({nbytes} bytes) is not page-aligned and malloc "
            f"is not glibc's (it lives in {malloc_in or 'an unknown mapping'}): which pages it "
            "owns alone is unknown"
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
        raise SharedKvError(
            f"the KV allocation at {ptr:#x} ({nbytes} bytes) is not one glibc mmapped chunk of "
            "its own; its edge pages may hold other allocations"
        )
    return start, end


def _mapping_path(address: int) -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5] if len(fields) > 5 else ""
    return ""


def _check_private_anonymous(start: int, end: int) -> None:
    """[start, end) must be private anonymous read-write memory (what malloc hands out)."""
    covered = start
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if hi <= covered or lo >= end:
                continue
            if lo > covered or fields[1] != "rw-p" or (len(fields) > 5 and fields[5]):
                raise SharedKvError(
                    f"the KV memory {start:#x}..{end:#x} is not all private anonymous memory "
                    f"({line.strip()!r})"
                )
            covered = hi
            if covered >= end:
                return
    raise SharedKvError(f"the KV memory {start:#x}..{end:#x} is not mapped whole")


def share_in_place(bindings: Mapping[int, LayerBinding]) -> SharedKv:
    """Back the pages under every binding's blocks with a sealed memfd, in place."""
    lo, hi, blocks = _extent(bindings)
    if blocks.device.type != "cpu":
        raise SharedKvError(f"vLLM's KV cache is on {blocks.device}; in-place sharing is CPU's")
    storage = blocks.untyped_storage()
    own_start, own_end = _owned_region(storage.data_ptr(), storage.nbytes())
    start = lo - lo % PAGE_BYTES
    end = -(-hi // PAGE_BYTES) * PAGE_BYTES
    if not own_start <= start < end <= own_end:
        raise SharedKvError(
            f"vLLM's blocks reach {lo:#x}..{hi:#x}, outside their allocation's own pages "
            f"{own_start:#x}..{own_end:#x}"
        )
    _check_private_anonymous(start, end)
    nbytes = end - start
    fd = sealed_memfd("hicache-vllm-kv", nbytes)
    rw, shared = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED
    staging = _libc.mmap(None, nbytes, rw, shared, fd, 0)
    if staging in (None, _MAP_FAILED):
        os.close(fd)
        raise SharedKvError(
            f"mapping a {nbytes}-byte memfd failed: {os.strerror(ctypes.get_errno())}"
        )
    try:
        for offset in range(0, nbytes, CHUNK_BYTES):
            size = min(CHUNK_BYTES, nbytes - offset)
            words = np.ctypeslib.as_array(
                (ctypes.c_uint64 * (size // 8)).from_address(start + offset)
            )
            if words.any():  # a zero chunk needs no copy: its pages are allocated zeroed below
                ctypes.memmove(staging + offset, start + offset, size)
            # nothing else writes vLLM's KV while it registers; the copy and the remap of a
            # chunk therefore see the same bytes
            got = _libc.mmap(start + offset, size, rw, shared | _MAP_FIXED, fd, offset)
            if got != start + offset:
                raise SharedKvError(  # pragma: no cover - the kernel refused a fixed mapping
                    f"remapping {size} bytes at {start + offset:#x} failed: "
                    f"{os.strerror(ctypes.get_errno())}; vLLM's KV memory is now partly shared"
                )
            # vLLM's zeroed cache was resident: so is its memfd (zero chunks allocated now,
            # every page mapped here), and the sidecar prefaults the same pages when it maps
            # them; otherwise the first copy into each block faults in both processes
            populate(start + offset, size, write=True)
    except BaseException:
        os.close(fd)
        raise
    finally:
        _libc.munmap(staging, nbytes)
    return SharedKv(fd, start, nbytes)


def blocks_pools(
    memory: SharedKv,
    bindings: Mapping[int, LayerBinding],
    geometries: Mapping[str, GroupGeometry],
) -> SharedPools:
    """vLLM's blocks as a `SharedPools` over `memory`: page p of a group is block p. It holds
    a descriptor of its own (a dup of the memfd's), since the client that registers it
    closes it with itself: a client that failed must not take the memory's descriptor along,
    or no later client could register it."""
    offsets: dict[str, list[list[int]]] = {}
    strides: dict[str, list[list[int]]] = {}
    pages: dict[str, int] = {}
    for name, geometry in geometries.items():
        offsets[name], strides[name] = [], []
        for layer_id in geometry.group.layer_ids:
            binding = bindings[layer_id]
            rows = binding.blocks
            if pages.setdefault(name, rows.shape[0]) != rows.shape[0]:
                raise SharedKvError(
                    f"group {name!r}: layer {layer_id} has {rows.shape[0]} vLLM blocks, another "
                    f"layer {pages[name]}; one pool needs one block count"
                )
            base = rows.data_ptr() - memory.base
            offsets[name].append([base + first for _, first, _ in binding.parts])
            strides[name].append([rows.stride(0)] * len(binding.parts))
    return SharedPools(
        os.dup(memory.fd), memory.nbytes, dict(geometries), pages, offsets, memory.buffer(), strides
    )


def blocks_device_pools(
    bindings: Mapping[int, LayerBinding], geometries: Mapping[str, GroupGeometry]
) -> dict[str, DevicePool]:
    """vLLM's blocks (any device) as hicache pools of page rows: for CUDA's
    `register_cuda_pools`, whose IPC handles carry each view's offset and stride."""
    pools = {}
    for name, geometry in geometries.items():
        layers = []
        for layer_id in geometry.group.layer_ids:
            binding = bindings[layer_id]
            layers.append(
                {tensor: binding.blocks[:, first:end] for tensor, first, end in binding.parts}
            )
        pools[name] = DevicePool(geometry, layers)
    return pools


@dataclass
class DataPlane:
    """How the sidecar reaches vLLM's blocks. `register`: registers them with a new client
    (None: the worker stages through a pool of its own); `stream`: CUDA, vLLM's current stream
    (the fence of a store and of a direct load), else None; `memory`: the CPU memory shared
    in place (kept open while vLLM runs)."""

    register: Callable[[Client], None] | None
    stream: Callable[[], Any]
    memory: SharedKv | None = None


def data_plane(
    layer_map: LayerMap,
    bindings: Mapping[int, LayerBinding],
    geometries: Mapping[str, GroupGeometry],
    staging_pages: int | None,
) -> DataPlane:
    """Directly (CPU: the KV memory shared in place; CUDA: IPC handles), or through a staging
    pool when a hicache group's layers lie in several vLLM KV-cache groups (each with its own
    block ids: one page id cannot name them all), `staging_pages` is set, or the memory
    cannot be shared (the reason is logged)."""
    spans = {
        g.name: sorted({bindings[i].vllm_group for i in g.layer_ids}) for g in layer_map.groups
    }
    why = None
    if staging_pages is not None:
        why = "kv_connector_extra_config.staging_pages is set"
    elif any(len(v) > 1 for v in spans.values()):
        why = f"hicache groups span several vLLM KV-cache groups ({spans})"
    device = next(iter(bindings.values())).blocks.device
    if why is None and device.type == "cuda":
        from hicache.transfer.cuda_ipc import current_stream

        cuda_pools = blocks_device_pools(bindings, geometries)
        log.info("hicache: vLLM's CUDA blocks registered by IPC handle (no staging)")
        return DataPlane(
            lambda c: c.register_cuda_pools(cuda_pools), lambda: current_stream(device)
        )
    memory = None
    if why is None:
        try:
            memory = share_in_place(bindings)
        except SharedKvError as exc:
            why = str(exc)
    if memory is None:
        log.info("hicache: staging vLLM's blocks (%s)", why)
        return DataPlane(None, lambda: None)
    log.info("hicache: vLLM's KV memory shared in place (no staging)")
    shared = memory
    # a pool (and descriptor) per client: a client closes its pool with itself
    return DataPlane(
        lambda c: c.register_pools(blocks_pools(shared, bindings, geometries)),
        lambda: None,
        memory,
    )
