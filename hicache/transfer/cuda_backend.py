"""`CudaCopyBackend`: page copies on dedicated CUDA streams, completion by events.

Lifecycle: created at start with a load stream (higher priority) and a backup stream, one
device staging buffer per stream, and one completion thread per stream (`cuda_completion`),
all on one device (`for_device` gives the backend of another device: siblings made on first
use and closed with this one, so a sidecar serving TP ranks on several GPUs stages each
rank's copies on its own GPU). `submit_walk` waits the walk's fence on the direction's
stream (`cuda_events.wait_fence`; a load's imported events are dropped there), enqueues
every layer, recording a blocking-sync event per layer; the consumer's `wait()` makes the
walk's device's current stream wait on that event (no host sync); the direction's
completion thread waits the events in order and reports `done` — a load's never waits
behind a backup's. `close` lets the pending walks complete, joins the threads, synchronizes
the device and unregisters the host buffers.

The completion threads are daemons registered with `workers`, so a process that raises
before `close()` still exits: at exit the backend is closed the same way with the joins
bounded, and where a join timed out (a copy still running) the device sync and the
unregistering are left to the process's end, never done under a copy in flight (workers.py
says why this design).

Page-granular moves are batched: a run of host pages is one `cudaMemcpyAsync` into staging,
and the device side is one gather (`index_select`) or scatter (`index_copy_`) kernel, never
one memcpy per page per layer. A layer larger than the staging buffer goes through it in
chunks of as many rows as fit (`chunk_runs`), in stream order. page_first host rows are
strided, and so are vLLM's blocks seen as page rows on the device: a run of rows strided on
either side is one `cudaMemcpy2DAsync` (`cuda_2d`), between host and staging or, when both
sides are runs, straight between host and device; one copy per page only where the runtime's
function cannot be found. torch's `copy_` never sees a strided view between host and device
(a strided host view makes a pageable temporary and copies synchronously; a strided device
view makes a device temporary of the whole run, beyond the staging budget). Nothing on the
submit path waits for the device.

Host buffers are allocated at exactly the size asked (an anonymous mapping, page-aligned, not
torch's pinned allocator, which rounds up to a power of two: a 36 GiB pool would pin 64 GiB),
prefaulted, then registered with `cudaHostRegister` (portable: pinned for every device) in
chunks of at most `pin_chunk_bytes` (a single 512 GiB registration fails), and unregistered at
close.

Device-side index sets are uploaded once per (direction, host index tensor) on the copy
stream and kept while that index tensor lives (`UploadCache`: weakly keyed, never by a bare
`id()`, which a new tensor may reuse once the old one is freed).

A layer event means "this layer landed" only for layers before a stop. When enqueuing layer
k raises (or the walk was cancelled before k), the walk stops at k, as on the CPU: layers
after k are not enqueued (reported as `CopyCancelled`), the signals return the stop from
`wait(i)` for every i >= k without a stream wait (there is nothing landed to order after),
and `is_done(i)` is false for them. What was enqueued before the error, layer k's partial
copies included, is covered by one more event that the completion thread waits before `done`
(pins must outlive in-flight copies); the listener hears `on_layer(k, failure)` after that
event, the layers before k each after their own. An event that itself reports a CUDA error on
the completion thread stops the walk there too (`FAILED_LAYER` at that position, and the
whole walk failed in `done`'s errors); a consumer already ordered after it learns at `done`.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from hicache.errors import TransferError
from hicache.memory.hugepages import advise_hugepages
from hicache.transfer import workers
from hicache.transfer.backend import (
    CancelToken,
    CopyBackend,
    CopyCancelled,
    Direction,
    Fence,
    LayerFailure,
    LayerListener,
    LayerPart,
    RowPair,
    WalkDone,
    WalkSignals,
)
from hicache.transfer.cuda_2d import Memcpy2D
from hicache.transfer.cuda_completion import PendingWalk, per_stream
from hicache.transfer.cuda_events import (
    CudaFence,
    CudaWalkSignals,
    join_cuda_fences,
    layer_event,
    wait_fence,
)
from hicache.transfer.cuda_host import (
    Run,
    UploadCache,
    chunk_runs,
    map_host_buffer,
    packed_rows,
    register_chunks,
)
from hicache.transfer.rows import Rows, check_row_pair

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
_PAGE = mmap.PAGESIZE

# ---- the backend -------------------------------------------------------------------------------


@dataclass(slots=True)
class _Registration:
    ptr: int
    size: int
    owner: object  # the mapping: its memory outlives the registration


class CudaCopyBackend(workers.WorkerOwner, CopyBackend):
    pins_host_memory = True

    def __init__(
        self,
        device: int | str | torch.device = 0,
        staging_bytes: int = 256 * 2**20,
        pin_chunk_bytes: int = 64 * 2**30,
    ):
        if not torch.cuda.is_available():
            raise TransferError("device.kind is cuda but torch sees no CUDA device")
        given = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if given.type != "cuda":
            raise TransferError(f"the CUDA copy backend needs a CUDA device, not {given}")
        index = given.index if given.index is not None else 0
        if not 0 <= index < torch.cuda.device_count():
            raise TransferError(
                f"CUDA device {index} does not exist; torch sees {torch.cuda.device_count()}"
            )
        self.device = torch.device("cuda", index)
        self.staging_bytes = staging_bytes
        self.pin_chunk_bytes = pin_chunk_bytes
        with torch.cuda.device(self.device):
            # lower numbers are higher priority; out-of-range values clamp to the highest
            self.load_stream = torch.cuda.Stream(self.device, priority=-1)  # type: ignore[no-untyped-call]
            self.backup_stream = torch.cuda.Stream(self.device, priority=0)  # type: ignore[no-untyped-call]
            self._staging = {
                Direction.LOAD: torch.empty(staging_bytes, dtype=torch.uint8, device=self.device),
                Direction.BACKUP: torch.empty(staging_bytes, dtype=torch.uint8, device=self.device),
            }
        self._registered: list[_Registration] = []
        self._memcpy_2d = Memcpy2D.load()
        self._uploads = UploadCache(self._upload)
        self._siblings: dict[int, CudaCopyBackend] = {}
        self._siblings_lock = threading.Lock()
        self._closed = False
        # one completion thread per stream: a load never waits behind a backup's walk
        self._completions = per_stream()
        workers.register(self)

    # ---- devices ------------------------------------------------------------------------

    def for_device(self, device: torch.device) -> CopyBackend:
        if self.serves(device):
            return self
        if device.type != "cuda":
            return super().for_device(device)  # refused, naming both devices
        index = device.index if device.index is not None else 0
        with self._siblings_lock:
            if self._closed:
                raise TransferError("the CUDA copy backend is closed; no new copies are accepted")
            sibling = self._siblings.get(index)
            if sibling is None:
                sibling = CudaCopyBackend(index, self.staging_bytes, self.pin_chunk_bytes)
                self._siblings[index] = sibling
        return sibling

    # ---- host memory ------------------------------------------------------------------

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        """Exactly `nbytes` (page-aligned), prefaulted, registered in chunks (portable)."""
        buffer, mapping = map_host_buffer(nbytes)
        advise_hugepages(buffer)  # before the first touch, so the prefault maps huge pages
        buffer.zero_()  # prefault before registering
        if nbytes == 0:
            return buffer
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        done: list[tuple[int, int]] = []
        try:
            with torch.cuda.device(self.device):
                register_chunks(
                    buffer.data_ptr(),
                    nbytes,
                    self.pin_chunk_bytes,
                    lambda ptr, size: int(
                        cudart.cudaHostRegister(ptr, size, _HOST_REGISTER_PORTABLE)
                    ),
                    done,
                )
        finally:  # what was registered is unregistered at close, the mapping kept until then
            self._registered.extend(_Registration(ptr, size, mapping) for ptr, size in done)
        return buffer

    @property
    def registered_bytes(self) -> int:
        """Host bytes this backend has registered (pinned) now."""
        return sum(r.size for r in self._registered)

    def index_device(self, side: Literal["device", "host"]) -> torch.device:
        # Index sets are built on the CPU; device-side ones are uploaded on the copy stream
        # itself (`_device_index`), so they are ordered with the kernels that read them and
        # never wait on the engine's stream.
        return torch.device("cpu")

    def _upload(self, index: torch.Tensor) -> torch.Tensor:
        """On the current (copy) stream: a pinned staging copy, then an async upload (torch's
        pinned allocator keeps the staging block until the copy has run)."""
        return index.pin_memory().to(self.device, non_blocking=True)

    def _device_index(self, rows: Rows, direction: Direction) -> torch.Tensor:
        assert rows.index is not None
        return self._uploads.get(direction.value, rows.index)

    def producer_fence(self, stream: object | None = None) -> Fence:
        """An event recorded now on `stream` (default: this thread's current stream on the
        backend's device): call it on the producer's thread, after the kernels that wrote the
        pages were enqueued."""
        target = torch.cuda.current_stream(self.device) if stream is None else stream
        if not isinstance(target, (torch.cuda.Stream, torch.Stream)):
            raise TransferError(f"producer_fence: {target!r} is not a CUDA stream")
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(target)  # a stream of another device is refused here, by torch
        return CudaFence(event)

    def join_fences(self, fences: Sequence[Fence | None]) -> Fence | None:
        return join_cuda_fences(fences)

    def import_fence(self, handle: bytes) -> Fence:
        """The engine's interprocess event, opened on this backend's device; a load's is
        released once its walk's stream waits on it (`wait_fence`)."""
        try:
            event = torch.cuda.Event.from_ipc_handle(self.device, handle)  # type: ignore[no-untyped-call]
        except (RuntimeError, TypeError, ValueError) as exc:
            raise TransferError(f"cannot open the fence's IPC event handle: {exc}") from None
        return CudaFence(event, imported=True)

    # ---- copies -------------------------------------------------------------------------

    def submit_walk(
        self,
        direction: Direction,
        layers: Sequence[Sequence[LayerPart]],
        done: WalkDone,
        after: Fence | None = None,
        cancel: CancelToken | None = None,
        on_layer: LayerListener | None = None,
    ) -> WalkSignals:
        if self._closed:
            raise TransferError("the CUDA copy backend is closed; no new copies are accepted")
        stream = self.load_stream if direction is Direction.LOAD else self.backup_stream
        staging = self._staging[direction]
        events: list[torch.cuda.Event | None] = []
        last: torch.cuda.Event | None = None
        errors: dict[int, BaseException] = {}
        stopped: LayerFailure | None = None
        with torch.cuda.stream(stream):
            wait_fence(stream, after, direction)
            for position, parts in enumerate(layers):
                if stopped is not None:
                    if parts:
                        errors[position] = stopped.skipped(position)
                    continue
                if not parts:
                    events.append(None)
                    continue
                try:
                    if cancel is not None and cancel.cancelled:
                        raise CopyCancelled(f"layer position {position}: walk cancelled")
                    self._enqueue_layer(direction, parts, staging, stream)
                except Exception as exc:  # reported through `done`, after what was enqueued
                    errors[position] = exc  # has landed: pins must outlive in-flight copies
                    stopped = LayerFailure.of(position, exc)
                    continue
                last = layer_event()
                last.record(stream)
                events.append(last)
            if stopped is not None:  # after the stopped layer's partial copies, if any
                last = layer_event()
                last.record(stream)
        signals = CudaWalkSignals(events, stopped, self.device)
        self._completions[direction].put(PendingWalk(signals, last, errors, done, on_layer))
        return signals

    def _enqueue_layer(
        self,
        direction: Direction,
        parts: Sequence[LayerPart],
        staging: torch.Tensor,
        stream: torch.cuda.Stream,
    ) -> None:
        for source, local_id in parts:
            for pair in source.row_pairs(direction, local_id):
                if direction is Direction.LOAD:
                    self._load_rows(pair, staging, stream)
                else:
                    self._backup_rows(pair, staging, stream)

    @staticmethod
    def _rows_per_chunk(staging: torch.Tensor, row_bytes: int) -> int:
        rows = staging.numel() // row_bytes
        if rows < 1:
            raise TransferError(
                f"one row of {row_bytes} bytes exceeds the staging buffer ({staging.numel()} "
                "bytes); raise the backend's staging_bytes"
            )
        return rows

    def _load_rows(self, pair: RowPair, staging: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """host rows -> device rows: runs H2D into staging, then one device scatter, per
        chunk of as many rows as staging holds."""
        src, src_rows, dst, dst_rows = pair
        if not check_row_pair(src, src_rows, dst, dst_rows):
            return
        n, row = src_rows.count, src.shape[1]
        if src_rows.is_run and dst_rows.is_run:
            self._copy_run(dst_rows.slice(dst), src_rows.slice(src), stream)
            return
        index = None if dst_rows.is_run else self._device_index(dst_rows, Direction.LOAD)
        for a, b, runs in chunk_runs(src_rows.runs(), n, self._rows_per_chunk(staging, row)):
            stage = staging[: (b - a) * row].view(b - a, row)
            self._host_runs(stage, src, runs, stream, to_device=True)
            if index is None:
                assert dst_rows.start is not None
                dst[dst_rows.start + a : dst_rows.start + b].copy_(stage)
            else:
                dst.index_copy_(0, index[a:b], stage)

    def _backup_rows(self, pair: RowPair, staging: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """device rows -> host rows: one device gather into staging, then runs D2H, per
        chunk of as many rows as staging holds."""
        src, src_rows, dst, dst_rows = pair
        if not check_row_pair(src, src_rows, dst, dst_rows):
            return
        n, row = src_rows.count, src.shape[1]
        if src_rows.is_run and dst_rows.is_run:
            self._copy_run(dst_rows.slice(dst), src_rows.slice(src), stream)
            return
        index = None if src_rows.is_run else self._device_index(src_rows, Direction.BACKUP)
        for a, b, runs in chunk_runs(dst_rows.runs(), n, self._rows_per_chunk(staging, row)):
            stage = staging[: (b - a) * row].view(b - a, row)
            if index is None:
                assert src_rows.start is not None
                stage.copy_(src[src_rows.start + a : src_rows.start + b])
            else:
                torch.index_select(src, 0, index[a:b], out=stage)
            self._host_runs(stage, dst, runs, stream, to_device=False)

    def _copy_run(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """dst[:] = src between a host run and a device run (both `[rows, width]`): one async
        copy when both sides' rows are packed, one 2-D copy when either side's are strided
        (page_first host rows; vLLM's blocks seen as page rows on the device), one copy per
        row only without the 2-D function. Never torch's `copy_` of a strided view: a
        strided host view stages through pageable memory, synchronously; a strided device
        view goes through a device temporary of the whole run (unbounded by the staging
        budget) and one more copy."""
        if packed_rows(src) and packed_rows(dst):
            dst.copy_(src, non_blocking=True)
        elif self._memcpy_2d is not None:
            self._memcpy_2d.copy(dst, src, stream)
        else:
            for k in range(src.shape[0]):
                dst[k].copy_(src[k], non_blocking=True)

    def _host_runs(
        self,
        stage: torch.Tensor,
        host: torch.Tensor,
        runs: Sequence[Run],
        stream: torch.cuda.Stream,
        *,
        to_device: bool,
    ) -> None:
        """Copy between contiguous staging rows and host rows, one async copy per run of
        pages (`runs`: positions in `stage`, first host row, length)."""
        for pos, first, length in runs:
            staged, hosted = stage[pos : pos + length], host[first : first + length]
            if to_device:
                self._copy_run(staged, hosted, stream)
            else:
                self._copy_run(hosted, staged, stream)

    def _stop(self, timeout_s: float | None) -> None:
        """Accept no more walks, let pending ones complete, join the completion threads, then
        synchronize and unregister the host buffers (`close`, `close_for_exit`)."""
        if not self._closed:
            self._closed = True
            workers.forget(self)
            for completion in self._completions.values():
                completion.stop()  # after every walk already pending
        with self._siblings_lock:
            siblings = list(self._siblings.values())
        for sibling in siblings:
            sibling._stop(timeout_s)
        threads = [c.thread for c in self._completions.values()]
        if threading.current_thread() in threads:
            return
        ended = [c.join(timeout_s) for c in self._completions.values()]
        if not all(ended):
            return  # a copy may still run: never unregister memory under it
        torch.cuda.synchronize(self.device)
        self._uploads.clear()
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        for registration in self._registered:
            cudart.cudaHostUnregister(registration.ptr)
        self._registered.clear()  # the mappings live on in whatever tensor still views them
