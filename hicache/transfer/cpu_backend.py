"""`CpuCopyBackend`: the copy API on one worker thread, so the scheduler's loop never blocks.

Lifecycle: created at start (the row-copy kernel is built or loaded, `row_kernel` names it;
the worker thread starts, with one torch intra-op thread of its own); `submit_walk` puts a
whole walk on a FIFO queue in one step and returns its progress; the worker runs the layers
in order, advancing the progress as each lands, and reports the walk once; `close` (the
owner's: `EmbeddedCache.close`, the sidecar's shutdown) lets queued work finish and joins
the thread. The thread is a daemon registered with `workers`: a process that raises before
`close()`, or never calls it, still exits — at exit the backend is closed the same way,
queued work included, with the join bounded (workers.py says why this design). A callback
that raises (`done`, `on_layer`) is logged and the worker goes on with the next walk: a dead
worker would leave every later walk unreported.

A layer that raises (or that the worker reaches after the walk was cancelled) stops the walk
there: the progress never passes it (`WalkProgress.stop`), the listener hears the stop at
once, the later layers are skipped (reported as `CopyCancelled`), then `done` runs.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
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
    WalkDone,
    WalkSignals,
)
from hicache.transfer.rows import STAGING_BLOCK_BYTES, copy_rows_cpu, row_kernel_name

log = logging.getLogger("hicache.transfer")

_Job = tuple[
    Direction,
    Sequence[Sequence[LayerPart]],
    WalkDone,
    CancelToken | None,
    "WalkProgress",
    LayerListener | None,
]


class WalkProgress(WalkSignals):
    """How far the worker has got through one walk: layers run in order, so layer i has
    landed exactly when `done_upto > i`; a stopped walk's `done_upto` stays at its stop's
    position for good. One condition per walk, not one event per layer."""

    __slots__ = ("_cond", "_failure", "done_upto")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self.done_upto = 0
        self._failure: LayerFailure | None = None

    @property
    def failure(self) -> LayerFailure | None:
        return self._failure

    def advance(self, upto: int) -> None:
        with self._cond:
            self.done_upto = upto
            self._cond.notify_all()

    def stop(self, failure: LayerFailure) -> None:
        """No layer from `failure.position` on will land: wake every waiter on one."""
        with self._cond:
            self._failure = failure
            self._cond.notify_all()

    def wait(self, position: int) -> LayerFailure | None:
        if self.done_upto > position:
            return None
        with self._cond:
            self._cond.wait_for(lambda: self.done_upto > position or self._failure is not None)
        return None if self.done_upto > position else self._failure

    def is_done(self, position: int) -> bool:
        return self.done_upto > position

    def all_done(self, num_layers: int) -> bool:
        return self.done_upto >= num_layers  # layers land in order


class CpuCopyBackend(workers.WorkerOwner, CopyBackend):
    pins_host_memory = False

    def __init__(
        self, staging_bytes: int = STAGING_BLOCK_BYTES, prefault: bool = True, native: bool = True
    ):
        self.device = torch.device("cpu")
        self.prefault = prefault
        self._native = native  # False: the numpy kernels even where the native one loads
        # built (or found in the per-user cache) now, not on the first walk; its name is for
        # the start-up report and stats
        self.row_kernel = row_kernel_name() if native else "numpy (native kernel not used)"
        self._staging = torch.empty(staging_bytes, dtype=torch.uint8)  # numpy kernels only
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # None: stop
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hicache-cpu-copy", daemon=True)
        self._thread.start()
        workers.register(self)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        advise_hugepages(buffer)  # before the first touch, so the prefault maps huge pages
        if self.prefault:
            buffer.zero_()  # touch every page now, not on the first copy
        return buffer

    def index_device(self, side: Literal["device", "host"]) -> torch.device:
        return self.device

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
            raise TransferError("the CPU copy backend is closed; no new copies are accepted")
        progress = WalkProgress()
        self._queue.put((direction, layers, done, cancel, progress, on_layer))
        return progress

    def _run(self) -> None:
        torch.set_num_threads(1)
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._walk(*item)
            except Exception:  # from a callback: the walk's copies are done or skipped
                log.exception("copy worker: a walk's callback raised; later walks still run")
            # the walk's pools and listener must not outlive it while this thread waits for
            # the next (a gone engine's shared memory would stay mapped until then)
            del item

    def _walk(
        self,
        direction: Direction,
        layers: Sequence[Sequence[LayerPart]],
        done: WalkDone,
        cancel: CancelToken | None,
        progress: WalkProgress,
        on_layer: LayerListener | None,
    ) -> None:
        errors: dict[int, BaseException] = {}
        stopped: LayerFailure | None = None
        for position, parts in enumerate(layers):
            if stopped is not None:
                if parts:
                    errors[position] = stopped.skipped(position)
                continue
            if parts:
                try:
                    self._start_layer(direction, position)
                    if cancel is not None and cancel.cancelled:
                        raise CopyCancelled(f"layer position {position}: walk cancelled")
                    self._run_layer(direction, position, parts)
                except Exception as exc:  # reported through `done`, never swallowed
                    errors[position] = exc
                    stopped = LayerFailure.of(position, exc)
                    progress.stop(stopped)
                    if on_layer is not None:
                        on_layer(position, stopped)
                    continue
            progress.advance(position + 1)
            if on_layer is not None:
                on_layer(position + 1, None)
        done(errors)

    def _start_layer(self, direction: Direction, position: int) -> None:
        """Before a layer with copies starts, ahead of the cancel check (the fake's gate)."""

    def _run_layer(self, direction: Direction, position: int, parts: Sequence[LayerPart]) -> None:
        """One layer's copies, on the worker thread (the fake backend hooks in here)."""
        staging, native = self._staging, self._native
        for source, local_id in parts:
            for src, src_rows, dst, dst_rows in source.row_pairs(direction, local_id):
                copy_rows_cpu(src, src_rows, dst, dst_rows, staging, use_native=native)

    def _stop(self, timeout_s: float | None) -> None:
        if not self._closed:
            self._closed = True
            workers.forget(self)
            self._queue.put(None)  # after every walk already queued
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
