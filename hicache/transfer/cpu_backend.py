"""`CpuCopyBackend`: the copy API on one worker thread, so the scheduler's loop never blocks.

Lifecycle: created at start (the worker thread starts, with one torch intra-op thread of its
own); `submit` puts a layer's copies on a FIFO queue and returns a signal; the worker runs
them in order and sets the signal; `close` lets queued work finish and joins the thread. Not
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
    CopyBackend,
    Direction,
    DoneCallback,
    Fence,
    LayerSignal,
    RowCopy,
)
from hicache.transfer.rows import copy_rows_cpu

_Job = tuple[tuple[RowCopy, ...], DoneCallback, "EventSignal"]


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

    def submit(
        self,
        direction: Direction,
        copies: Sequence[RowCopy],
        done: DoneCallback,
        after: Fence | None = None,
    ) -> LayerSignal:
        if self._closed:
            raise TransferError("the CPU copy backend is closed; no new copies are accepted")
        signal = EventSignal()
        self._queue.put((tuple(copies), done, signal))
        return signal

    def _run(self) -> None:
        torch.set_num_threads(1)
        while True:
            item = self._queue.get()
            if item is None:
                return
            copies, done, signal = item
            error: BaseException | None = None
            try:
                for c in copies:
                    copy_rows_cpu(c.src, c.src_rows, c.dst, c.dst_rows, self._staging)
            except Exception as exc:  # reported to the op through `done`, never swallowed
                error = exc
            signal.set()
            done(error)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
