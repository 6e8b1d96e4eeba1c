"""The CUDA backend's pure helpers (no device; unit-tested on the CPU): chunking a layer's
runs through the staging buffer (`chunk_runs`), whether a `[rows, width]` view is packed
(`packed_rows`), exact-size host mappings (`map_host_buffer`) and their registration in
chunks (`register_chunks`), and `UploadCache`, the device index sets kept while their host
index tensor lives.

`UploadCache` lifecycle: an entry is made on the first `get` of a (stream key, host index
tensor), served while that very tensor lives, queued for dropping by the tensor's
weak-reference callback when it is freed (no lock taken there), and dropped at the next
`get` (or when the cache holds more than `capacity`, oldest first, or at `clear`).
"""

from __future__ import annotations

import mmap
import queue
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from hicache.errors import TransferError

Run = tuple[int, int, int]  # (position in the set, first row, length)


def chunk_runs(runs: Sequence[Run], total: int, limit: int) -> list[tuple[int, int, list[Run]]]:
    """Positions 0..total split into consecutive chunks of at most `limit`: per chunk its
    positions [a, b) and the parts of `runs` inside it, with positions relative to a. `runs`
    cover 0..total in order (what `Rows.runs()` gives)."""
    if limit < 1:
        raise ValueError(f"a chunk holds at least one row; limit {limit}")
    chunks: list[tuple[int, int, list[Run]]] = []
    pending = list(runs)
    k = 0
    for a in range(0, total, limit):
        b = min(total, a + limit)
        inside: list[Run] = []
        while k < len(pending):
            pos, first, length = pending[k]
            if pos >= b:
                break
            take = min(length, b - pos)
            inside.append((pos - a, first, take))
            if take < length:  # the run goes on into the next chunk
                pending[k] = (pos + take, first + take, length - take)
                break
            k += 1
        chunks.append((a, b, inside))
    return chunks


def packed_rows(rows: torch.Tensor) -> bool:
    """A `[rows, width]` view whose rows lie back to back (one row always does)."""
    return rows.shape[0] <= 1 or rows.stride(0) == rows.shape[1]


def map_host_buffer(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """A 1-D uint8 tensor of exactly `nbytes` over a fresh anonymous mapping (page-aligned,
    the mapping rounded up to whole pages only), not yet touched. The tensor holds the
    mapping; never `close()` it while the tensor may be used."""
    mapping = mmap.mmap(
        -1,
        max(nbytes, 1),
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
    )
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes), mapping


def register_chunks(
    base: int,
    nbytes: int,
    chunk_bytes: int,
    register: Callable[[int, int], int],
    registered: list[tuple[int, int]],
) -> None:
    """Register [base, base + nbytes) in chunks of at most `chunk_bytes` with `register(ptr,
    size) -> status`, appending each success to `registered` (so the caller unregisters what
    was registered even when a later chunk fails, which raises naming the memlock limit)."""
    for offset in range(0, nbytes, chunk_bytes):
        size = min(chunk_bytes, nbytes - offset)
        status = int(register(base + offset, size))
        if status != 0:
            raise TransferError(
                f"cudaHostRegister of {size} bytes at offset {offset} of a {nbytes}-byte host "
                f"buffer failed with status {status}; check the memlock limit (ulimit -l)"
            )
        registered.append((base + offset, size))


class UploadCache:
    """Device copies of host index tensors, per stream key, kept while the host tensor lives.

    An entry is found by identity (`id()` while a weak reference to the tensor is alive, and
    the reference checked to be that very tensor), and dropped when its host tensor is freed,
    so a new index tensor that happens to get a freed one's `id()` is never served the old
    upload. At most `capacity` entries (the oldest go first). Thread-safe: weak-reference
    callbacks run on whichever thread frees the tensor."""

    def __init__(self, upload: Callable[[torch.Tensor], torch.Tensor], capacity: int = 256):
        self._upload = upload
        self.capacity = capacity
        self._entries: OrderedDict[
            tuple[str, int], tuple[weakref.ref[torch.Tensor], torch.Tensor]
        ] = OrderedDict()
        self._lock = threading.Lock()
        # keys whose host tensor died, queued by the weak-reference callbacks and dropped at
        # the next get: a callback can run inside a garbage-collection pass that an
        # allocation under `_lock` set off, on this very thread, so it must take no lock
        # (SimpleQueue.put is reentrant) and touch no dict mid-insertion
        self._dead: queue.SimpleQueue[tuple[tuple[str, int], weakref.ref[torch.Tensor]]] = (
            queue.SimpleQueue()
        )
        self.uploads = 0

    def __len__(self) -> int:
        with self._lock:
            self._drop_dead()
            return len(self._entries)

    def _drop_dead(self) -> None:
        """Under `_lock`: forget the entries whose host tensor was freed."""
        while True:
            try:
                key, ref = self._dead.get_nowait()
            except queue.Empty:
                return
            entry = self._entries.get(key)
            if entry is not None and entry[0] is ref:
                del self._entries[key]

    def get(self, stream_key: str, index: torch.Tensor) -> torch.Tensor:
        key = (stream_key, id(index))
        with self._lock:
            self._drop_dead()
            hit = self._entries.get(key)
            if hit is not None and hit[0]() is index:  # a dead or another tensor's: no hit
                self._entries.move_to_end(key)
                return hit[1]
        uploaded = self._upload(index)
        self.uploads += 1
        dead = self._dead

        def forget(ref: weakref.ref[torch.Tensor], key: tuple[str, int] = key) -> None:
            dead.put((key, ref))

        ref = weakref.ref(index, forget)
        with self._lock:
            self._drop_dead()
            self._entries[key] = (ref, uploaded)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return uploaded

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._drop_dead()
