"""The copy-backend interface: what the scheduler asks of a device, whatever the device is.

Lifecycle: `alloc_host` at start (pinned on CUDA); per op, `rows()` builds the page-index sets
once; per walk, `submit_walk()` enqueues every layer's work in one call (never blocking the
caller) and returns `WalkSignals` that complete layer by layer; `close()` drains and stops.
A layer's work is a list of (source, local id) parts that the backend expands into row
copies on its own thread, so the scheduler's cost per layer is a few tuple appends. The only
modules that touch `torch.cuda` are this package's CUDA files.

A failed layer stops its walk. When layer k's copy raises (or layer k is reached after the
walk was cancelled), no layer from k on lands: layers after k are not copied (each is
reported to `done` as `CopyCancelled`, "skipped"), because the op ends failed whatever they
do and stopping frees the copy thread for the next walk. The stop is one `LayerFailure`
(position k, its kind, its reason); the signals return it from `wait(i)` for every i >= k,
and `on_layer(k, failure)` tells a listener at once, before the walk's `done`. Layers before
k landed and stay landed.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Literal, Protocol

import torch

from hicache.errors import TransferError
from hicache.transfer.rows import Rows


class Direction(StrEnum):
    LOAD = "load"  # L2 host -> L1 device
    BACKUP = "backup"  # L1 device -> L2 host


RowPair = tuple[torch.Tensor, Rows, torch.Tensor, Rows]  # src, src rows, dst, dst rows


class RowSource(Protocol):
    """Something that expands, on the backend's thread, into the row copies of one layer."""

    def row_pairs(self, direction: Direction, local_id: int) -> Iterable[RowPair]: ...


LayerPart = tuple[RowSource, int]  # (source, local layer id): one group of one op, one layer


@dataclass(frozen=True, slots=True)
class RowCopy:
    """A single explicit copy dst[dst_rows] = src[src_rows] of uint8 `[pages, row]` views; a
    `RowSource` of its own (the local id is ignored), for callers below the scheduler."""

    src: torch.Tensor
    src_rows: Rows
    dst: torch.Tensor
    dst_rows: Rows

    def row_pairs(self, direction: Direction, local_id: int) -> Iterable[RowPair]:
        return ((self.src, self.src_rows, self.dst, self.dst_rows),)


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
    """A layer's copies were skipped: its walk was cancelled, or stopped at an earlier layer
    whose copy failed."""


class StopKind(IntEnum):
    """Why a walk stopped (the values are also the sidecar's counter-row codes, shm.py)."""

    FAILED_LAYER = 1  # the copy of the layer at the stop position raised
    CANCELLED = 2  # the walk was cancelled before the layer at the stop position started
    FAILED_WALK = 3  # the walk failed as a whole (never submitted, or the backend failed it)


@dataclass(frozen=True, slots=True)
class LayerFailure:
    """A walk's stop: no layer from `position` (stage-local) on landed, for `reason`
    ("cancelled", or the copy error as "Type: message"). Layers before `position` landed."""

    position: int
    kind: StopKind
    reason: str

    @classmethod
    def of(cls, position: int, exc: BaseException) -> LayerFailure:
        """The stop a layer's exception makes (`CopyCancelled`: a cancelled walk)."""
        if isinstance(exc, CopyCancelled):
            return cls(position, StopKind.CANCELLED, "cancelled")
        return cls(position, StopKind.FAILED_LAYER, f"{type(exc).__name__}: {exc}")

    def cause(self, layer_id: int, stop_layer_id: int) -> str:
        """Why layer `layer_id` did not land, as `wait_layer` says it; `stop_layer_id` is the
        global id of the layer at `position`."""
        if self.kind is StopKind.FAILED_LAYER and layer_id != stop_layer_id:
            return f"layer {stop_layer_id} failed first ({self.reason})"
        return self.reason

    def skipped(self, position: int) -> CopyCancelled:
        """What `done` hears for a later layer the stop kept from starting."""
        return CopyCancelled(
            f"layer position {position}: skipped, the walk stopped at layer position "
            f"{self.position} ({self.reason})"
        )


LayerListener = Callable[[int, LayerFailure | None], None]
"""`on_layer(upto, None)`: layers `0..upto-1` have landed. `on_layer(upto, failure)`, at most
once and last: the walk stopped at `upto == failure.position`; no later layer lands."""


class WalkSignals(abc.ABC):
    """Per-layer completion of one submitted walk, as the consumer waits on it."""

    @abc.abstractmethod
    def wait(self, position: int) -> LayerFailure | None:
        """CPU: block until layer `position` landed (None) or the walk stopped at or before it
        (the stop). CUDA: make the current stream wait on it (no host sync), or return the
        stop when its submission (or an earlier layer's) failed. The caller raises."""

    @abc.abstractmethod
    def is_done(self, position: int) -> bool:
        """Layer `position` has landed (a stopped layer never has)."""

    @property
    @abc.abstractmethod
    def failure(self) -> LayerFailure | None:
        """The walk's stop, once it stopped; None while no layer failed."""

    def all_done(self, num_layers: int) -> bool:
        return all(self.is_done(i) for i in range(num_layers))


class ReadyWalk(WalkSignals):
    """A walk with nothing to copy: every layer is done from the start."""

    def wait(self, position: int) -> LayerFailure | None:
        return None

    def is_done(self, position: int) -> bool:
        return True

    @property
    def failure(self) -> LayerFailure | None:
        return None


READY = ReadyWalk()


class Fence:
    """A point in the engine's work that a walk must be ordered after (a backend's subclass
    carries what it needs, e.g. a CUDA event): a backup after the kernels that wrote its
    pages, a load after the work that last used (or zeroed) the pages it fills. A plain
    `Fence()` (`NO_FENCE`) orders nothing: the engine has finished with the pages (it
    synchronised, or it works on the CPU).

    The contract (CUDA): the fence is taken where the pages were written — on the producer's
    thread, on the stream its kernels ran on, before anything else may overwrite them — never
    on the scheduler's thread later. In-process that is `backend.producer_fence(stream)` (or
    `TieredCache.store`, which takes it on entry, on the caller's thread); over IPC the engine
    records an interprocess event and sends its handle with the store, and the sidecar opens
    it (`import_fence`). The backup stream waits on it (`cudaStreamWaitEvent`: no host sync).
    """


NO_FENCE = Fence()


class JoinedFence(Fence):
    """Several ops' fences for one merged walk, on a backend whose fences order nothing of
    their own (the CPU's; CUDA joins its events into one `CudaFence`)."""

    def __init__(self, fences: Sequence[Fence]):
        self.fences = tuple(fences)


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

    def producer_fence(self, stream: object | None = None) -> Fence | None:
        """Mark the producer's current position: CUDA, an event recorded on `stream` (default:
        the calling thread's current stream on this backend's device). Call it on the thread
        and after the work that wrote the pages. None on CPU (nothing to order)."""
        return None

    def import_fence(self, handle: bytes) -> Fence:
        """A fence from another process: CUDA, an interprocess event's IPC handle, opened on
        this backend's device. Refused where fences cannot cross processes (CPU)."""
        raise TransferError(
            f"a fence (an IPC event handle) needs the CUDA copy backend; this one copies on "
            f"{self.device}"
        )

    def join_fences(self, fences: Sequence[Fence | None]) -> Fence | None:
        """One fence after all of `fences` (the ops of a merged load walk each bring theirs):
        None when there is none, the one there is, or a `JoinedFence` of several (CUDA
        joins their events, one stream wait each)."""
        present = list({id(f): f for f in fences if f is not None}.values())
        if len(present) <= 1:
            return present[0] if present else None
        return JoinedFence(present)

    def serves(self, device: torch.device) -> bool:
        """Can this backend copy pools on `device`? (Its own device type and index.)"""
        mine = self.device
        if device.type != mine.type:
            return False
        return device.type == "cpu" or (device.index or 0) == (mine.index or 0)

    def for_device(self, device: torch.device) -> CopyBackend:
        """The backend that copies pools on `device`: this one, or (CUDA) a sibling bound to
        that device, created on first use and closed with this one. Refused otherwise."""
        if self.serves(device):
            return self
        raise TransferError(
            f"pools on {device}, but this copy backend copies on {self.device}; a backend "
            "serves the pools of its own device only"
        )

    @abc.abstractmethod
    def submit_walk(
        self,
        direction: Direction,
        layers: Sequence[Sequence[LayerPart]],
        done: WalkDone,
        after: Fence | None = None,
        cancel: CancelToken | None = None,
        on_layer: LayerListener | None = None,
    ) -> WalkSignals:
        """Enqueue a whole walk, layer by layer in order, without blocking; the returned
        signals complete layer by layer. `done(errors)` is called once, from any thread, when
        every layer has finished, failed or been skipped (after every copy that was enqueued
        has landed). `on_layer(upto, None)` is called, in order and from the backend's thread,
        when layers `0..upto-1` have landed, and `on_layer(k, failure)` once if the walk
        stops at layer k, before `done` (the sidecar mirrors both into shared memory); it
        must be cheap and must not raise."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finish queued copies and stop; idempotent."""
