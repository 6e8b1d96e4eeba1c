"""`CpuCopyBackend`: the copy API on one worker thread, so the scheduler's loop never blocks.

Lifecycle: created at start (the worker thread starts, with one torch intra-op thread of its
own); `submit_walk` puts a whole walk on a FIFO queue in one step and returns a signal per
layer; the worker runs the layers in order, sets each layer's signal as it lands, and reports
the walk once; `close` lets queued work finish and joins the thread. Not
a daemon: the owner must close it (the scheduler does, in its shutdown).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Literal

import torch

from hicache.errors import TransferError
from hicache.memory.hugepages import advise_hugepages
from hicache.transfer.backend import (
    READY,
    CancelToken,
    CopyBackend,
    CopyCancelled,
    Direction,
    Fence,
    LayerSignal,
    RowCopy,
    WalkDone,
)
from hicache.transfer.rows import copy_rows_cpu

_Job = tuple[list[tuple[int, Sequence[RowCopy], "EventSignal"]], WalkDone, CancelToken | None]


class EventSignal(LayerSignal):
    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def wait(self) -> None:
        self._event.wait()

    def is_done(self) -> bool:
        return self._event.is_set()


class CpuCopyBackend(CopyBackend):
    pins_host_memory = False

    def __init__(self, staging_bytes: int = 64 * 2**20, prefault: bool = True):
        self.device = torch.device("cpu")
        self.prefault = prefault
        self._staging = torch.empty(staging_bytes, dtype=torch.uint8)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # None: stop
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hicache-cpu-copy")
        self._thread.start()

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
        layers: Sequence[Sequence[RowCopy]],
        done: WalkDone,
        after: Fence | None = None,
        cancel: CancelToken | None = None,
    ) -> list[LayerSignal]:
        if self._closed:
            raise TransferError("the CPU copy backend is closed; no new copies are accepted")
        signals: list[LayerSignal] = []
        work: list[tuple[int, Sequence[RowCopy], EventSignal]] = []
        for position, copies in enumerate(layers):
            if copies:
                signal = EventSignal()
                work.append((position, copies, signal))
                signals.append(signal)
            else:
                signals.append(READY)
        self._queue.put((work, done, cancel))
        return signals

    def _run(self) -> None:
        torch.set_num_threads(1)
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, done, cancel = item
            errors: dict[int, BaseException] = {}
            for position, copies, signal in work:
                try:
                    if cancel is not None and cancel.cancelled:
                        raise CopyCancelled(f"layer position {position}: walk cancelled")
                    self._run_layer(position, copies)
                except Exception as exc:  # reported to the op through `done`, never swallowed
                    errors[position] = exc
                signal.set()
            done(errors)

    def _run_layer(self, position: int, copies: Sequence[RowCopy]) -> None:
        """One layer's copies, on the worker thread (the fake backend hooks in here)."""
        for c in copies:
            copy_rows_cpu(c.src, c.src_rows, c.dst, c.dst_rows, self._staging)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
