"""Sealed memfds shared by an engine process and the sidecar: the engine's KV pools
(`SharedPools`, mapped by the sidecar with `map_pools`) and the descriptor checks both they and
the per-load counter files (`counters.CounterFile`) go through. Bytes never cross the socket;
only a manifest of where they live.

Every such memfd is created by the ENGINE (`sealed_memfd`), sized once and sealed
(`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`) before anyone maps it: nobody, the engine
included, can shrink it afterwards, so no mapping of it can ever fault (a truncated shared file
delivers SIGBUS to every process touching the lost pages — a sidecar serving many
engines must not die of one). Pool layout: per cache group, per layer, per tensor one contiguous
`[slots, *shape]` tensor, each at a 4 KiB-aligned offset; or, where the manifest gives
`page_strides` (an engine's own KV memory shared in place, e.g. vLLM's blocks, K and V side by
side), per tensor its page rows at that stride from its offset (rows in bounds; tensors of
such a pool may share bytes, as vLLM's cache groups overlay one allocation: only the engine's
own memory is at stake).

`register_pools` sends descriptor NUMBERS in the engine's own fd table, never paths. The sidecar
opens `/proc/<pid>/fd/<n>` where `<pid>` is the Unix socket's peer, as the kernel reports it
(`SO_PEERCRED`) — not what the engine claims — so a session can only ever register memory its
own process holds: another engine's pool cannot be named. The sidecar checks what it opened (a
regular shmem file, not hugetlb, sealed against shrinking, of the stated size, mappable for
writing) and every offset (in bounds, aligned, no two tensors overlapping), maps it, and closes
its descriptor. Nothing is created in /dev/shm: a memfd's memory goes when the last descriptor
and mapping go, so neither a crashed engine nor a crashed sidecar leaves files behind. The
sidecar drops its mappings when the session ends.
"""

from __future__ import annotations

import fcntl
import functools
import itertools
import mmap
import os
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.channel.prefault import allocated_extents, populate
from hicache.errors import PoolManifestError, PoolShapeError
from hicache.memory import DevicePool, GroupGeometry

ALIGN_BYTES = 4096
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _tensor_bytes(geometry: GroupGeometry, num_pages: int, tensor: str) -> int:
    return num_pages * geometry.row_bytes(tensor)


def sealed_memfd(name: str, nbytes: int) -> int:
    """A memfd of exactly `nbytes`, sealed so that no one can resize it (its descriptor)."""
    fd = os.memfd_create(f"{name}-{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_fd(fd: int, nbytes: int) -> torch.Tensor:
    """`nbytes` of a shared descriptor as a uint8 tensor; the mapping lives while the tensor
    (or any view of it) does, and outlives the descriptor."""
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


@dataclass(frozen=True, slots=True)
class PeerMemory:
    """A mapping of an engine's memfd, and the memfd's identity (st_dev, st_ino): the same
    memory reached through another process's descriptor has the same identity. `allocated`:
    the byte ranges that held pages when it was mapped (what `prefault` fills in)."""

    tensor: torch.Tensor
    identity: tuple[int, int]
    allocated: tuple[tuple[int, int], ...] = ()

    def prefault(self, stop: threading.Event | None = None) -> int:
        """Fill this process's page tables for the pages the engine had allocated, so no copy
        faults on them (`prefault.py`); the bytes done. Blocking: run it in a thread."""
        base = self.tensor.data_ptr()
        done = 0
        for start, end in self.allocated:
            done += populate(base + start, end - start, write=False, stop=stop)
            if stop is not None and stop.is_set():
                break
        return done


def _mount_id(fd: int) -> int | None:
    """The mount a descriptor's file is on (procfs only: never the file's own filesystem)."""
    with open(f"/proc/self/fdinfo/{fd}") as info:
        for line in info:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    return None


@functools.cache
def _memfd_mount() -> int | None:
    """The kernel's internal mount memfds live on: that of one made here."""
    fd = os.memfd_create("hicache-probe", os.MFD_CLOEXEC)
    try:
        return _mount_id(fd)
    finally:
        os.close(fd)


def map_peer_fd(
    pid: int, fd: int, nbytes: int, where: str, alive: Callable[[], bool] = lambda: True
) -> PeerMemory:
    """Map descriptor `fd` of process `pid` (the socket's peer, from the kernel), after
    checking it is memory nobody can shrink under us. `alive`: asked once the descriptor is
    held, whether `pid` is still the process that connected (not a reused pid).

    The descriptor is first taken with O_PATH, which calls no driver and no filesystem: a
    terminal would otherwise become the sidecar's controlling terminal (its engine could
    then signal it), a FUSE file could block the event loop. Only a file on the memfd mount
    is looked at further, and reopened for writing (O_NOCTTY)."""
    told = f"{where}: descriptor {fd} of engine pid {pid}"
    try:
        handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise PoolManifestError(
            f"{told} cannot be opened ({exc.strerror or exc}); send the fd of a memfd made by "
            "SharedPools.create (the sidecar must run as the engine's uid, or as root, and "
            "see its pid namespace)"
        ) from None
    try:
        if not alive():
            raise PoolManifestError(
                f"{told}: the process that connected has exited (its pid is another's now)"
            )
        if _mount_id(handle) != _memfd_mount():
            target = os.readlink(f"/proc/self/fd/{handle}")
            raise PoolManifestError(
                f"{told} is not a memfd ({target!r} is on another filesystem); create the "
                "pool with SharedPools.create"
            )
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode):
            raise PoolManifestError(f"{told} is not a memfd (not a regular file)")
        own = os.open(f"/proc/self/fd/{handle}", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(handle)
    try:
        try:
            seals = fcntl.fcntl(own, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if not seals & fcntl.F_SEAL_SHRINK:
            raise PoolManifestError(
                f"{told} is not sealed against shrinking (F_SEAL_SHRINK): a shrunk file would "
                "fault the sidecar; create it with SharedPools.create"
            )
        if info.st_blksize != mmap.PAGESIZE:
            raise PoolManifestError(
                f"{told} has {info.st_blksize}-byte pages (hugetlb?); only plain memfds of "
                f"{mmap.PAGESIZE}-byte pages are mapped"
            )
        if info.st_size != nbytes:
            raise PoolManifestError(
                f"{where}: nbytes {nbytes} does not match the memfd's size {info.st_size}"
            )
        try:
            mapped = map_fd(own, nbytes)
        except (OSError, ValueError) as exc:
            raise PoolManifestError(
                f"{told} cannot be mapped for writing ({exc}); is it write-sealed?"
            ) from None
        try:
            allocated = tuple(allocated_extents(own, nbytes))
        except OSError:  # no SEEK_DATA here: nothing is prefaulted, copies fault as they go
            allocated = ()
        return PeerMemory(mapped, (info.st_dev, info.st_ino), allocated)
    finally:
        os.close(own)


@dataclass
class SharedPools:
    """The engine's side: KV pools in one sealed memfd, as tensors the engine computes with.
    `fd` stays open while the pools are registered (the sidecar opens it again on reconnect);
    `close` closes it (the memory goes when the last mapping does)."""

    fd: int
    nbytes: int
    geometries: dict[str, GroupGeometry]
    num_pages: dict[str, int]
    offsets: dict[str, list[list[int]]]  # group -> layer -> offset per tensor (geometry order)
    buffer: torch.Tensor
    # group -> layer -> bytes from one page's row to the next, per tensor; None: contiguous
    page_strides: dict[str, list[list[int]]] | None = None

    @classmethod
    def create(
        cls,
        geometries: Mapping[str, GroupGeometry],
        num_pages: int | Mapping[str, int],
        *,
        prefault: bool = True,
    ) -> SharedPools:
        """Pools of `num_pages` pages per group in a new sealed memfd. `prefault`: every page
        allocated and mapped now, as an engine's zeroed KV cache is (no copy faults on a
        page later, here or in the sidecar, which fills its page tables for the pages that
        exist when it maps them); False: pages are allocated as they are first written (a
        staging pool sized for a worst case, mostly never touched)."""
        pages = {
            name: num_pages if isinstance(num_pages, int) else num_pages[name]
            for name in geometries
        }
        offsets: dict[str, list[list[int]]] = {}
        cursor = 0
        for name, geom in geometries.items():
            if pages[name] < 1:
                raise PoolShapeError(f"group {name!r}: num_pages {pages[name]} must be >= 1")
            offsets[name] = []
            for _ in range(geom.num_layers):
                row = []
                for tensor, _ in geom.tensors:
                    row.append(cursor)
                    cursor = _align(cursor + _tensor_bytes(geom, pages[name], tensor))
                offsets[name].append(row)
        nbytes = max(cursor, ALIGN_BYTES)
        fd = sealed_memfd("hicache-pool", nbytes)
        try:
            buffer = map_fd(fd, nbytes)
            if prefault:
                populate(buffer.data_ptr(), nbytes, write=True)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, nbytes, dict(geometries), pages, offsets, buffer)

    def manifest(self) -> dict[str, Any]:
        strides = self.page_strides or {}
        return {
            "fd": self.fd,
            "nbytes": self.nbytes,
            "groups": {
                name: {"num_pages": self.num_pages[name], "offsets": self.offsets[name]}
                | ({"page_strides": strides[name]} if name in strides else {})
                for name in self.geometries
            },
        }

    def device_pools(self) -> dict[str, DevicePool]:
        return _views(self.buffer, self.geometries, self.num_pages, self.offsets, self.page_strides)

    def close(self) -> None:
        """Close the descriptor (idempotent); the tensors stay valid while referenced."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _views(
    buffer: torch.Tensor,
    geometries: Mapping[str, GroupGeometry],
    num_pages: Mapping[str, int],
    offsets: Mapping[str, Sequence[Sequence[int]]],
    page_strides: Mapping[str, Sequence[Sequence[int]]] | None = None,
) -> dict[str, DevicePool]:
    pools = {}
    for name, geom in geometries.items():
        layers = []
        strides = (page_strides or {}).get(name)
        for local_id, layer_offsets in enumerate(offsets[name]):
            tensors = {}
            for index, ((tensor, shape), offset) in enumerate(
                zip(geom.tensors, layer_offsets, strict=True)
            ):
                if strides is not None:  # page rows at a stride: the engine's own layout
                    rows = (num_pages[name], geom.row_bytes(tensor))
                    tensors[tensor] = buffer.as_strided(
                        rows, (strides[local_id][index], 1), buffer.storage_offset() + offset
                    )
                    continue
                size = _tensor_bytes(geom, num_pages[name], tensor)
                slots = num_pages[name] * geom.slots_per_page
                flat = buffer[offset : offset + size].view(geom.dtype_of(tensor))
                tensors[tensor] = flat.view(slots, *shape)
            layers.append(tensors)
        pools[name] = DevicePool(geom, layers)
    return pools


def map_pools(
    manifest: Mapping[str, Any],
    geometries: Mapping[str, GroupGeometry],
    peer_pid: int,
    alive: Callable[[], bool] = lambda: True,
) -> tuple[dict[str, DevicePool], PeerMemory]:
    """The sidecar's side: check the manifest against the geometries, then map the peer's
    memfd (`map_peer_fd` checks the descriptor). Returns the pools' views and the mapping
    (its identity, and `prefault` for the caller to run off its event loop)."""
    nbytes = manifest["nbytes"]
    groups = manifest["groups"]
    if set(groups) != set(geometries):
        raise PoolManifestError(
            f"groups {sorted(groups)} given; the layout's groups are {sorted(geometries)}"
        )
    spans: list[tuple[int, int, str]] = []
    strided = any(entry.get("page_strides") is not None for entry in groups.values())
    for name, geom in geometries.items():
        entry = groups[name]
        pages, offsets = entry["num_pages"], entry["offsets"]
        strides = entry.get("page_strides")
        if strided and strides is None:
            raise PoolManifestError(
                f"groups.{name}: no page_strides; give them for every group or for none"
            )
        if len(offsets) != geom.num_layers or (
            strides is not None and len(strides) != len(offsets)
        ):
            raise PoolManifestError(
                f"groups.{name}.offsets: {len(offsets)} layers"
                + ("" if strides is None else f", page_strides: {len(strides)}")
                + f"; the group has {geom.num_layers}"
            )
        for local_id, layer_offsets in enumerate(offsets):
            layer_strides = None if strides is None else strides[local_id]
            if len(layer_offsets) != len(geom.tensors) or (
                layer_strides is not None and len(layer_strides) != len(geom.tensors)
            ):
                raise PoolManifestError(
                    f"groups.{name}.offsets[{local_id}]: {len(layer_offsets)} tensors"
                    + ("" if layer_strides is None else f", page_strides: {len(layer_strides)}")
                    + f"; expected {len(geom.tensors)} ({', '.join(t for t, _ in geom.tensors)})"
                )
            for index, ((tensor, _), offset) in enumerate(
                zip(geom.tensors, layer_offsets, strict=True)
            ):
                where = f"groups.{name}.offsets[{local_id}] ({tensor})"
                size = _tensor_bytes(geom, pages, tensor)
                itemsize = geom.dtype_of(tensor).itemsize
                if offset % itemsize:
                    raise PoolManifestError(f"{where}: offset {offset} is not {itemsize}-aligned")
                if layer_strides is not None:
                    stride, row = layer_strides[index], geom.row_bytes(tensor)
                    if stride < row or stride % itemsize:
                        raise PoolManifestError(
                            f"groups.{name}.page_strides[{local_id}] ({tensor}): {stride}; "
                            f"allowed: a multiple of {itemsize} of at least the row's {row} bytes"
                        )
                    size = (pages - 1) * stride + row
                if offset + size > nbytes:
                    raise PoolManifestError(
                        f"{where}: bytes {offset}..{offset + size} run past the pool's {nbytes}"
                    )
                spans.append((offset, offset + size, where))
    spans.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end and not strided:  # strided pools are the engine's own overlaid memory
            raise PoolManifestError(f"{second} overlaps {first}")
    # no slack: an engine must not make the sidecar map more than its tensors (address space)
    needed = max(_align(max((end for _, end, _ in spans), default=0)), ALIGN_BYTES)
    if nbytes != needed:
        raise PoolManifestError(
            f"nbytes {nbytes}: the tensors end at byte {needed} (4 KiB-aligned); allowed: "
            "exactly that"
        )
    memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if nbytes > memory_bytes:
        raise PoolManifestError(
            f"nbytes {nbytes}: more than this machine's memory ({memory_bytes} bytes); "
            "allowed: a pool that fits in RAM"
        )
    memory = map_peer_fd(peer_pid, manifest["fd"], nbytes, "fd", alive)
    pages_of = {name: groups[name]["num_pages"] for name in geometries}
    offsets = {n: groups[n]["offsets"] for n in geometries}
    strides = {n: groups[n]["page_strides"] for n in geometries} if strided else None
    return _views(memory.tensor, geometries, pages_of, offsets, strides), memory
