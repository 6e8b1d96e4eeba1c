"""The copy-backend interface: what the scheduler asks of a device, whatever the device is.

Lifecycle: `alloc_host` at start (pinned on CUDA); per op, `rows()` builds the page-index sets
once; per layer, `submit()` enqueues that layer's copies (never blocking the caller) and
returns a `LayerSignal` that completes when they land; `close()` drains and stops. The only
modules that touch `torch.cuda` are this package's CUDA files.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

import torch

from hicache.transfer.rows import Rows


class Direction(StrEnum):
    LOAD = "load"  # L2 host -> L1 device
    BACKUP = "backup"  # L1 device -> L2 host


@dataclass(frozen=True, slots=True)
class RowCopy:
    """One tensor of one layer: dst[dst_rows] = src[src_rows] (uint8 `[pages, row]` views)."""

    src: torch.Tensor
    src_rows: Rows
    dst: torch.Tensor
    dst_rows: Rows

    @property
    def nbytes(self) -> int:
        return self.src_rows.count * self.src.shape[1]


WalkDone = Callable[[dict[int, BaseException]], None]  # layer position -> its error


class CancelToken:
    """Set by the scheduler to stop a walk: layers not yet started are skipped (and reported
    as cancelled); copies already enqueued on a device stream still land."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def cancel(self) -> None:
        self._set = True

    @property
    def cancelled(self) -> bool:
        return self._set


class CopyCancelled(Exception):
    """A layer's copies were skipped because its walk was cancelled."""


class LayerSignal(abc.ABC):
    """Completion of one layer's copies, as the consumer waits on it."""

    @abc.abstractmethod
    def wait(self) -> None:
        """CPU: block until the copies landed. CUDA: make the current stream wait (no host
        sync)."""

    @abc.abstractmethod
    def is_done(self) -> bool: ...


class ReadySignal(LayerSignal):
    """A layer with nothing to copy: done from the start."""

    def wait(self) -> None:
        return None

    def is_done(self) -> bool:
        return True


READY = ReadySignal()


class Fence:
    """A point in the producer's work that a backup must be ordered after (a backend's
    subclass carries what it needs, e.g. a CUDA event)."""


class CopyBackend(abc.ABC):
    device: torch.device
    pins_host_memory: bool

    @abc.abstractmethod
    def alloc_host(self, nbytes: int) -> torch.Tensor:
        """A prefaulted 1-D uint8 host buffer (pinned and registered in chunks on CUDA)."""

    def rows(self, ids: Sequence[int], side: Literal["device", "host"]) -> Rows:
        """Index set for one side of a copy, on the device that will read it."""
        return Rows.of(ids, self.index_device(side))

    @abc.abstractmethod
    def index_device(self, side: Literal["device", "host"]) -> torch.device: ...

    def producer_fence(self) -> Fence | None:
        """Mark the producer's current position (CUDA: an event on the current stream)."""
        return None

    @abc.abstractmethod
    def submit_walk(
        self,
        direction: Direction,
        layers: Sequence[Sequence[RowCopy]],
        done: WalkDone,
        after: Fence | None = None,
        cancel: CancelToken | None = None,
    ) -> list[LayerSignal]:
        """Enqueue a whole walk, layer by layer in order, without blocking; returns one signal
        per layer (READY for a layer with no copies). `done(errors)` is called once, from any
        thread, when every layer has finished or failed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finish queued copies and stop; idempotent."""
