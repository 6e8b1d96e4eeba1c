"""The CUDA events of a walk: fences (what its copies wait for) and signals (what tells a
consumer that a layer landed). Pure plumbing over `torch.cuda.Event` and streams, so the
rules below are unit-tested on the CPU with stand-ins that record what they were asked.

A fence's lifecycle: made (`producer_fence` in-process, or opened from the engine's IPC
handle: `imported`) -> held by its op -> waited on the walk's stream at submission
(`wait_fence`: `cudaStreamWaitEvent`, no host sync, the dependency captured at that call)
-> released. A load's imported events are released right after that wait, before the load's
reply (the engine keeps its event until the load ended anyway): CUDA leaves any operation on
an imported event undefined once its exporter destroyed it, destruction included. A store's
stay with its op: its walks (one per round) each wait on them, and the engine keeps a
store's event until the reply.

A walk's signals: one blocking-sync event per landed layer (`layer_event`: the completion
thread's `synchronize()` sleeps in the driver instead of spinning a core); a consumer's
`wait(i)` orders the current stream *of the walk's device* after layer i (with another
device current, its current stream would be the wrong one, and it would read stale pages).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hicache.transfer.backend import Direction, Fence, LayerFailure, WalkSignals


def layer_event() -> torch.cuda.Event:
    """An event recorded after a layer's copies: blocking-sync (cudaEventBlockingSync), so a
    thread that synchronizes on it yields the core while the copy runs."""
    return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]


class CudaFence(Fence):
    """Events recorded after the engine's work (or opened from the engine's IPC handles,
    `imported`); the walk's stream waits on each when the walk is submitted. A merged load
    walk's is the join of its ops' (`parts`), so releasing it releases theirs."""

    def __init__(
        self, *events: Any, imported: bool = False, parts: Sequence[CudaFence] = ()
    ) -> None:
        self._events: list[Any] = list(events)
        self.imported = imported
        self.parts = tuple(parts)

    @property
    def events(self) -> tuple[Any, ...]:
        return (*self._events, *(e for part in self.parts for e in part.events))

    def release_imported(self) -> None:
        """Drop the imported events (this fence's and its parts'): waited on already."""
        if self.imported:
            self._events.clear()
        for part in self.parts:
            part.release_imported()


def join_cuda_fences(fences: Sequence[Fence | None]) -> CudaFence | None:
    """One fence after all of `fences`' events (each distinct fence once); None without any."""
    joined = tuple({id(f): f for f in fences if isinstance(f, CudaFence)}.values())
    if not any(f.events for f in joined):
        return None
    return joined[0] if len(joined) == 1 else CudaFence(parts=joined)


def wait_fence(stream: Any, fence: Fence | None, direction: Direction) -> None:
    """Make `stream` wait on every event of `fence` (the walk's submission, on the walk's
    stream); then a load drops its imported events (the wait holds what it needs)."""
    if not isinstance(fence, CudaFence):
        return
    for event in fence.events:
        stream.wait_event(event)
    if direction is Direction.LOAD:
        fence.release_imported()


class CudaWalkSignals(WalkSignals):
    """One event per layer before the stop that copied something (None for a layer with
    nothing to copy); `failure`, the stop, from submission or from the completion thread;
    `device`, the walk's, whose current stream a consumer's `wait` orders."""

    __slots__ = ("_failure", "device", "events")

    def __init__(self, events: list[Any], failure: LayerFailure | None, device: torch.device):
        self.events = events  # one per position before the stop (all, when it did not stop)
        self._failure = failure
        self.device = device

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
            torch.cuda.current_stream(self.device).wait_event(event)
        return None

    def is_done(self, position: int) -> bool:
        failure = self._failure
        if failure is not None and position >= failure.position:
            return False
        event = self.events[position]
        return event is None or bool(event.query())
