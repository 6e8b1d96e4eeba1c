"""`CudaCopyBackend`: page copies on dedicated CUDA streams, completion by events.

Lifecycle: created at start with a load stream (higher priority) and a backup stream, one
device staging buffer per stream, and a completion thread. `submit_walk` enqueues every layer
on the direction's stream — after the producer's fence for backups — recording an event per
layer; the consumer's `wait()` makes its current stream wait on that event (no host sync); the
completion thread waits the events in order and reports `done`. `close` lets the pending walks
complete, joins the thread, synchronizes the device and unregisters the host buffers.

The completion thread is a daemon registered with `workers`, so a process that raises before
`close()` still exits: at exit the backend is closed the same way with the join bounded, and
where the join timed out (a copy still running) the device sync and the unregistering are left
to the process's end, never done under a copy in flight (workers.py says why this design).

Page-granular moves are batched: a run of host pages is one `cudaMemcpyAsync` into staging,
and the device side is one gather (`index_select`) or scatter (`index_copy_`) kernel, never
one memcpy per page per layer.
page_first host rows are strided: a run of pages is one `cudaMemcpy2DAsync` (`cuda_2d`), or
one copy per page where the runtime's function cannot be found.
Host buffers are pinned: small ones by torch's pinned allocator, large ones registered with
`cudaHostRegister` in chunks of at most `pin_chunk_bytes` (a single 512 GiB registration fails).

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

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from hicache.errors import TransferError
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
from hicache.transfer.rows import Rows, check_row_pair

log = logging.getLogger("hicache.transfer")


class CudaWalkSignals(WalkSignals):
    """One event per layer before the stop that copied something (None for a layer with
    nothing to copy); `failure`, the stop, from submission or from the completion thread."""

    __slots__ = ("_failure", "events")

    def __init__(self, events: list[torch.cuda.Event | None], failure: LayerFailure | None):
        self.events = events  # one per position before the stop (all, when it did not stop)
        self._failure = failure

    @property
    def failure(self) -> LayerFailure | None:
        return self._failure

    def stop(self, failure: LayerFailure) -> None:
        """The completion thread saw an event fail: keep the first stop (the earliest)."""
        if self._failure is None or failure.position < self._failure.position:
            self._failure = failure

    def wait(self, position: int) -> LayerFailure | None:
        failure = self._failure
        if failure is not None and position >= failure.position:
            return failure
        event = self.events[position]
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        return None

    def is_done(self, position: int) -> bool:
        failure = self._failure
        if failure is not None and position >= failure.position:
            return False
        event = self.events[position]
        return event is None or bool(event.query())  # type: ignore[no-untyped-call]


@dataclass(frozen=True, slots=True)
class _PendingWalk:
    """What the completion thread waits for: each landed layer's event, then `last` (after
    everything enqueued, a stopped layer's partial copies included), then `done`."""

    signals: CudaWalkSignals
    last: torch.cuda.Event | None
    errors: dict[int, BaseException]
    done: WalkDone
    on_layer: LayerListener | None


class CudaFence(Fence):
    def __init__(self, event: torch.cuda.Event):
        self.event = event


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
        self.device = torch.device("cuda", torch.device(device).index or 0)
        self.pin_chunk_bytes = pin_chunk_bytes
        # lower numbers are higher priority; out-of-range values clamp to the highest
        self.load_stream = torch.cuda.Stream(self.device, priority=-1)  # type: ignore[no-untyped-call]
        self.backup_stream = torch.cuda.Stream(self.device, priority=0)  # type: ignore[no-untyped-call]
        self._staging = {
            Direction.LOAD: torch.empty(staging_bytes, dtype=torch.uint8, device=self.device),
            Direction.BACKUP: torch.empty(staging_bytes, dtype=torch.uint8, device=self.device),
        }
        self._registered: list[tuple[int, int]] = []
        self._memcpy_2d = Memcpy2D.load()
        self._uploaded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending: queue.SimpleQueue[_PendingWalk | None] = queue.SimpleQueue()  # None: stop
        self._closed = False
        self._thread = threading.Thread(
            target=self._complete, name="hicache-cuda-complete", daemon=True
        )
        self._thread.start()
        workers.register(self)

    # ---- host memory ------------------------------------------------------------------

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        if nbytes <= self.pin_chunk_bytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            buffer.zero_()
            return buffer
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        buffer.zero_()  # prefault before registering
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        base = buffer.data_ptr()
        for offset in range(0, nbytes, self.pin_chunk_bytes):
            size = min(self.pin_chunk_bytes, nbytes - offset)
            status = cudart.cudaHostRegister(base + offset, size, 0)
            if int(status) != 0:
                raise TransferError(
                    f"cudaHostRegister of {size} bytes at offset {offset} failed with status "
                    f"{int(status)}; check the memlock limit (ulimit -l)"
                )
            self._registered.append((base + offset, size))
        return buffer

    def index_device(self, side: Literal["device", "host"]) -> torch.device:
        # Index sets are built on the CPU; device-side ones are uploaded on the copy stream
        # itself (`_device_index`), so they are ordered with the kernels that read them and
        # never wait on the engine's stream.
        return torch.device("cpu")

    def _device_index(self, rows: Rows) -> torch.Tensor:
        assert rows.index is not None
        key = id(rows.index)
        hit = self._uploaded.get(key)
        if hit is not None and hit[0] is rows.index:
            return hit[1]
        uploaded = rows.index.pin_memory().to(self.device, non_blocking=True)
        if len(self._uploaded) >= 256:
            self._uploaded.pop(next(iter(self._uploaded)))
        self._uploaded[key] = (rows.index, uploaded)
        return uploaded

    def producer_fence(self) -> Fence:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return CudaFence(event)

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
            if isinstance(after, CudaFence):
                stream.wait_event(after.event)
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
                    self._enqueue_layer(direction, parts, staging)
                except Exception as exc:  # reported through `done`, after what was enqueued
                    errors[position] = exc  # has landed: pins must outlive in-flight copies
                    stopped = LayerFailure.of(position, exc)
                    continue
                last = torch.cuda.Event()  # type: ignore[no-untyped-call]
                last.record(stream)
                events.append(last)
            if stopped is not None:  # after the stopped layer's partial copies, if any
                last = torch.cuda.Event()  # type: ignore[no-untyped-call]
                last.record(stream)
        signals = CudaWalkSignals(events, stopped)
        self._pending.put(_PendingWalk(signals, last, errors, done, on_layer))
        return signals

    def _enqueue_layer(
        self, direction: Direction, parts: Sequence[LayerPart], staging: torch.Tensor
    ) -> None:
        for source, local_id in parts:
            for pair in source.row_pairs(direction, local_id):
                if direction is Direction.LOAD:
                    self._load_rows(pair, staging)
                else:
                    self._backup_rows(pair, staging)

    @staticmethod
    def _stage_view(staging: torch.Tensor, rows: int, row_bytes: int) -> torch.Tensor:
        if rows * row_bytes > staging.numel():
            raise TransferError(
                f"one layer's copy of {rows * row_bytes} bytes exceeds the staging buffer "
                f"({staging.numel()} bytes); submit fewer pages per op"
            )
        return staging[: rows * row_bytes].view(rows, row_bytes)

    def _load_rows(self, pair: RowPair, staging: torch.Tensor) -> None:
        """host rows -> device rows: runs H2D into staging, then one device scatter."""
        src, src_rows, dst, dst_rows = pair
        if not check_row_pair(src, src_rows, dst, dst_rows):
            return
        n, row = src_rows.count, src.shape[1]
        if src_rows.is_run and dst_rows.is_run:
            dst_rows.slice(dst).copy_(src_rows.slice(src), non_blocking=True)
            return
        stage = self._stage_view(staging, n, row)
        self._host_runs(stage, src, src_rows, to_device=True)
        if dst_rows.is_run:
            dst_rows.slice(dst).copy_(stage)
        else:
            dst.index_copy_(0, self._device_index(dst_rows), stage)

    def _backup_rows(self, pair: RowPair, staging: torch.Tensor) -> None:
        """device rows -> host rows: one device gather into staging, then runs D2H."""
        src, src_rows, dst, dst_rows = pair
        if not check_row_pair(src, src_rows, dst, dst_rows):
            return
        n, row = src_rows.count, src.shape[1]
        if src_rows.is_run and dst_rows.is_run:
            dst_rows.slice(dst).copy_(src_rows.slice(src), non_blocking=True)
            return
        stage = self._stage_view(staging, n, row)
        if src_rows.is_run:
            stage.copy_(src_rows.slice(src))
        else:
            torch.index_select(src, 0, self._device_index(src_rows), out=stage)
        self._host_runs(stage, dst, dst_rows, to_device=False)

    def _host_runs(
        self, stage: torch.Tensor, host: torch.Tensor, rows: Rows, *, to_device: bool
    ) -> None:
        """Copy between contiguous staging rows and host rows, one async copy per run of
        pages: a plain copy when the host rows are packed (layer_first), a 2-D copy when they
        are strided (page_first), one copy per page only without the 2-D function."""
        packed = host.stride(0) == host.shape[1]
        stream = torch.cuda.current_stream(self.device)
        for pos, first, length in rows.runs():
            staged, hosted = stage[pos : pos + length], host[first : first + length]
            dst, src = (staged, hosted) if to_device else (hosted, staged)
            if packed:
                dst.copy_(src, non_blocking=True)
            elif self._memcpy_2d is not None:
                self._memcpy_2d.copy(dst, src, stream)
            else:
                for k in range(length):
                    dst[k].copy_(src[k], non_blocking=True)

    def _complete(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            signals, errors, on_layer = item.signals, item.errors, item.on_layer
            position = 0
            try:
                # events record in order: `last` covers the walk; with a listener, each
                # landed layer's event is waited in turn so it hears of every layer as it lands
                if on_layer is not None:
                    for position, event in enumerate(signals.events):
                        if event is not None:
                            event.synchronize()
                        on_layer(position + 1, None)
                    position = len(signals.events)
                if item.last is not None:
                    item.last.synchronize()
            except Exception as exc:  # the walk failed as a whole; reported through `done`
                errors = {**errors, -1: exc}
                signals.stop(LayerFailure.of(position, exc))
            stopped = signals.failure
            try:
                if on_layer is not None and stopped is not None:
                    on_layer(stopped.position, stopped)
                item.done(errors)
            except Exception:  # a dead completion thread would leave every later walk unheard
                log.exception("completion thread: a walk's callback raised; later walks go on")
            # nothing of the walk (its pools, the IPC-mapped memory, the listener) outlives it
            # while this thread waits for the next
            del item, signals, errors, on_layer

    def _stop(self, timeout_s: float | None) -> None:
        """Accept no more walks, let pending ones complete, join the completion thread, then
        synchronize and unregister the host buffers (`close`, `close_for_exit`)."""
        if not self._closed:
            self._closed = True
            workers.forget(self)
            self._pending.put(None)  # after every walk already pending
        if threading.current_thread() is self._thread:
            return
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return  # a copy may still run: never unregister memory under it
        torch.cuda.synchronize(self.device)
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        for ptr, _ in self._registered:
            cudart.cudaHostUnregister(ptr)
        self._registered.clear()
