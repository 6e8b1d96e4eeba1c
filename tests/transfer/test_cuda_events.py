"""Issue #36: the CUDA walk's events, completion and copies, reviewed against CUDA's and
PyTorch's semantics. On the CPU with stand-ins that record what they were asked (finding 1:
a load's per-layer signals never wait behind a backup's completion; 2: a consumer's wait
orders the walk's device's stream; 6: strided device rows take the 2-D copy, never torch's
temporaries; 7: a load's imported fence is dropped once waited on; 9: layer events are
blocking-sync), and, marked `gpu`, the same on a device."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hicache.transfer import Direction
from hicache.transfer.backend import LayerFailure, RowCopy
from hicache.transfer.cuda_completion import PendingWalk, per_stream
from hicache.transfer.cuda_events import (
    CudaFence,
    CudaWalkSignals,
    join_cuda_fences,
    layer_event,
    wait_fence,
)
from hicache.transfer.rows import Rows

WAIT_S = 60.0  # a deadline for events that must come; never reached when the code is right


class HeldEvent:
    """A layer event that lands when the test says so (`land`)."""

    def __init__(self) -> None:
        self._landed = threading.Event()

    def land(self) -> None:
        self._landed.set()

    def synchronize(self) -> None:
        assert self._landed.wait(WAIT_S), "an event the test never landed was waited on"

    def query(self) -> bool:
        return self._landed.is_set()


def walk(events: list[Any], heard: list[tuple[str, int]], name: str) -> tuple[PendingWalk, Any]:
    finished = threading.Event()
    signals = CudaWalkSignals(events, None, torch.device("cuda", 0))

    def on_layer(upto: int, failure: LayerFailure | None) -> None:
        heard.append((name, upto))

    return PendingWalk(signals, events[-1], {}, lambda e: finished.set(), on_layer), finished


# ---- finding 1: a load never waits behind a backup ------------------------------------------


def test_a_loads_layers_are_heard_while_an_earlier_backup_waits_on_its_fence() -> None:
    """The backup (queued first) is gated on an engine fence that has not fired; the load
    queued after it lands layer by layer. The load's listener must hear every layer and its
    `done` must come while the backup still waits — on 7767ef8 one FIFO thread served both
    and the load heard nothing until the backup's event landed."""
    completions = per_stream()
    try:
        heard: list[tuple[str, int]] = []
        gated = HeldEvent()
        backup, backup_done = walk([gated], heard, "backup")
        load_events = [HeldEvent() for _ in range(3)]
        load, load_done = walk(load_events, heard, "load")
        completions[Direction.BACKUP].put(backup)
        completions[Direction.LOAD].put(load)
        for event in load_events:
            event.land()
        assert load_done.wait(WAIT_S), "the load's walk never completed behind the backup"
        assert heard == [("load", 1), ("load", 2), ("load", 3)]
        assert not backup_done.is_set()
        gated.land()
        assert backup_done.wait(WAIT_S)
        assert heard[-1] == ("backup", 1)
    finally:
        for completion in completions.values():
            completion.stop()
        assert all(c.join(WAIT_S) for c in completions.values())


def test_each_stream_completes_its_walks_in_order_and_stops_after_them() -> None:
    completions = per_stream()
    heard: list[tuple[str, int]] = []
    walks = [walk([HeldEvent()], heard, f"load {i}") for i in range(3)]
    for pending, _ in walks:
        completions[Direction.LOAD].put(pending)
    for completion in completions.values():
        completion.stop()  # after the walks already queued
    for pending, _ in reversed(walks):
        pending.signals.events[0].land()  # landed in reverse: still heard in stream order
    assert all(c.join(WAIT_S) for c in completions.values())
    assert heard == [("load 0", 1), ("load 1", 1), ("load 2", 1)]
    assert all(finished.is_set() for _, finished in walks)


def test_a_failing_event_stops_its_walk_and_later_walks_go_on() -> None:
    class Broken:
        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    completions = per_stream()
    try:
        heard: list[tuple[str, int]] = []
        errors: list[dict[int, BaseException]] = []
        signals = CudaWalkSignals([None, Broken()], None, torch.device("cuda", 0))
        failed = threading.Event()

        def done(e: dict[int, BaseException]) -> None:
            errors.append(e)
            failed.set()

        completions[Direction.LOAD].put(
            PendingWalk(signals, None, {}, done, lambda u, f: heard.append(("bad", u)))
        )
        later = HeldEvent()
        later.land()
        after, after_done = walk([later], heard, "next")
        completions[Direction.LOAD].put(after)
        assert after_done.wait(WAIT_S)
        assert failed.is_set()
        assert signals.failure is not None
        assert signals.failure.position == 1
        assert "illegal memory access" in signals.failure.reason
        assert -1 in errors[0]
        assert heard == [("bad", 1), ("bad", 1), ("next", 1)]  # layer 0, the stop at 1
    finally:
        for completion in completions.values():
            completion.stop()


# ---- finding 2: the consumer's wait orders the walk's device ---------------------------------


def test_a_consumers_wait_orders_the_current_stream_of_the_walks_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[object] = []
    waited: list[object] = []

    class Stream:
        def wait_event(self, event: object) -> None:
            waited.append(event)

    def current_stream(device: object = None) -> Stream:
        asked.append(device)
        return Stream()

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    event = HeldEvent()
    signals = CudaWalkSignals([event, None], None, torch.device("cuda", 1))
    assert signals.wait(0) is None
    assert signals.wait(1) is None  # nothing copied at that layer: nothing to wait on
    assert asked == [torch.device("cuda", 1)]  # never the current device's (None)
    assert waited == [event]
    stop = LayerFailure.of(1, RuntimeError("boom"))
    signals.stop(stop)
    assert signals.wait(1) is stop
    assert asked == [torch.device("cuda", 1)]  # a stopped layer orders nothing


# ---- finding 6: strided device rows take the 2-D copy -----------------------------------------


class Recorded2D:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: object) -> None:
        self.calls.append((tuple(dst.stride()), tuple(src.stride())))
        dst.copy_(src)


@pytest.mark.parametrize("strided", ["device", "host", "both", "neither"])
def test_a_run_strided_on_either_side_is_one_2d_copy(strided: str) -> None:
    """vLLM's blocks seen as page rows are strided on the device. On 7767ef8 only the host
    side was judged, so a packed host run into strided device rows went to torch's
    `copy_`: a device temporary of the whole run (beyond the staging budget) and one more
    copy. Either side strided must take the one 2-D copy (it takes both pitches)."""
    from hicache.transfer.cuda_backend import CudaCopyBackend

    wide_host, wide_device = (
        torch.arange(6 * 32, dtype=torch.uint8).view(6, 32),
        torch.zeros(6, 48, dtype=torch.uint8),
    )
    host = wide_host[:, :16] if strided in ("host", "both") else wide_host[:, :16].clone()
    device = wide_device[:, 8:24] if strided in ("device", "both") else torch.zeros(6, 16).byte()
    fake = SimpleNamespace(_memcpy_2d=Recorded2D())
    CudaCopyBackend._copy_run(fake, device, host, stream=None)  # type: ignore[arg-type]
    assert torch.equal(device, host)
    assert len(fake._memcpy_2d.calls) == (0 if strided == "neither" else 1)


def test_without_the_2d_function_a_strided_run_goes_row_by_row() -> None:
    from hicache.transfer.cuda_backend import CudaCopyBackend

    host = torch.arange(4 * 16, dtype=torch.uint8).view(4, 16)
    device = torch.zeros(4, 40, dtype=torch.uint8)[:, 4:20]
    CudaCopyBackend._copy_run(SimpleNamespace(_memcpy_2d=None), device, host, None)  # type: ignore[arg-type]
    assert torch.equal(device, host)


# ---- finding 7: a load's imported fence is dropped once waited on ----------------------------


class Event:
    """An imported event: alive while anything holds it."""


class Stream:
    def __init__(self) -> None:
        self.waited: list[weakref.ref[Event]] = []

    def wait_event(self, event: Event) -> None:
        self.waited.append(weakref.ref(event))


def test_a_loads_imported_fence_is_released_right_after_the_streams_wait() -> None:
    """The engine keeps only its last few events; the sidecar held a load's imported one
    until the walk ended (on 7767ef8), past the original's destruction with more fenced
    requests in flight — undefined in CUDA. The stream's wait captures what it needs."""
    stream = Stream()
    fence = CudaFence(Event(), imported=True)
    wait_fence(stream, fence, Direction.LOAD)
    assert len(stream.waited) == 1
    assert fence.events == ()
    gc.collect()
    assert stream.waited[0]() is None, "the imported event outlived the wait"


def test_a_merged_loads_join_releases_every_ops_imported_fence() -> None:
    stream = Stream()
    first, second = CudaFence(Event(), imported=True), CudaFence(Event(), imported=True)
    joined = join_cuda_fences([first, None, second, first])
    assert joined is not None
    assert len(joined.events) == 2  # each op's fence once
    wait_fence(stream, joined, Direction.LOAD)
    assert first.events == ()  # the ops hold them: released there
    assert second.events == ()
    gc.collect()
    assert [ref() for ref in stream.waited] == [None, None]


def test_a_stores_fence_and_an_in_process_fence_are_kept() -> None:
    """A store's rounds each wait on its fence (the engine keeps its event until the
    reply); an in-process fence is the producer's own: neither is dropped at the wait."""
    stream = Stream()
    store = CudaFence(Event(), imported=True)
    wait_fence(stream, store, Direction.BACKUP)
    wait_fence(stream, store, Direction.BACKUP)  # a second round waits on it again
    own = CudaFence(Event())
    wait_fence(stream, own, Direction.LOAD)
    assert len(store.events) == 1
    assert len(own.events) == 1
    assert len(stream.waited) == 3
    assert join_cuda_fences([None, CudaFence()]) is None
    wait_fence(stream, None, Direction.LOAD)  # no fence: nothing to wait on
    assert len(stream.waited) == 3


# ---- finding 9: blocking-sync layer events ----------------------------------------------------


def test_layer_events_are_blocking_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spin-waiting `synchronize` burns a core per device for every walk; a blocking-sync
    event (cudaEventBlockingSync) lets the completion thread sleep."""
    made: list[dict[str, Any]] = []

    class Made:
        def __init__(self, **kwargs: Any) -> None:
            made.append(kwargs)

    monkeypatch.setattr(torch.cuda, "Event", Made)
    layer_event()
    assert made == [{"blocking": True}]


# ---- on a device ---------------------------------------------------------------------------

gpu = pytest.mark.gpu


def gpu_sleep(seconds: float) -> None:
    """Keep the current stream busy for about `seconds` (`torch.cuda._sleep` spins clock
    cycles; the SM clock rate is in kHz; the boost clock makes it shorter, never longer)."""
    rate = getattr(torch.cuda.get_device_properties(0), "clock_rate", 2_000_000)
    torch.cuda._sleep(int(seconds * rate * 1e3))  # type: ignore[no-untyped-call]


@pytest.fixture
def cuda() -> Iterator[Any]:
    from hicache.transfer.cuda_backend import CudaCopyBackend

    made = CudaCopyBackend(0, staging_bytes=4 * 2**20)
    try:
        yield made
    finally:
        made.close()


def rows_copy(backend: Any, direction: Direction, rows: int = 16) -> RowCopy:
    device = torch.zeros(rows, 4096, dtype=torch.uint8, device="cuda")
    host = backend.alloc_host(rows * 4096).view(rows, 4096)
    ids = Rows.of(range(rows))
    if direction is Direction.LOAD:
        return RowCopy(host, ids, device, ids)
    return RowCopy(device, ids, host, ids)


@gpu
def test_on_a_device_a_backup_behind_a_fence_does_not_delay_a_later_loads_layers(
    cuda: Any,
) -> None:
    """A backup gated on an engine fence that fires only after a long kernel (about 3 s on
    a side stream); a load submitted after it: the load's layers are heard, and its walk is
    done, while the backup still waits."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        gpu_sleep(3.0)
    fence = cuda.producer_fence(side)
    backup_done, load_done = threading.Event(), threading.Event()
    heard: list[int] = []
    backup = rows_copy(cuda, Direction.BACKUP)
    cuda.submit_walk(Direction.BACKUP, [[(backup, 0)]], lambda e: backup_done.set(), fence)
    load = rows_copy(cuda, Direction.LOAD)
    cuda.submit_walk(
        Direction.LOAD,
        [[(load, 0)], [(load, 0)]],
        lambda e: load_done.set(),
        on_layer=lambda upto, failure: heard.append(upto),
    )
    assert load_done.wait(WAIT_S)
    assert heard == [1, 2]
    assert not backup_done.is_set(), "the backup ended before its fence fired"
    assert not side.query()  # the fence's kernel still runs: the load never waited for it
    assert backup_done.wait(WAIT_S)


@gpu
def test_on_a_device_strided_device_rows_copy_without_a_temporary(cuda: Any) -> None:
    """vLLM's blocks as page rows (strided on the device) from a packed host run, 64 MiB:
    no device allocation beyond the staging buffers (torch's `copy_` would allocate the
    whole run, beyond `staging_bytes`), and the bytes land."""
    rows, width, pitch = 2048, 32 * 1024, 48 * 1024
    blocks = torch.zeros(rows, pitch, dtype=torch.uint8, device="cuda")
    device_rows = blocks[:, 4096 : 4096 + width]
    host = cuda.alloc_host(rows * width).view(rows, width)
    host.copy_(torch.randint(0, 256, (rows, width), dtype=torch.uint8))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.max_memory_allocated()
    for direction in (Direction.LOAD, Direction.BACKUP):
        src, dst = (host, device_rows) if direction is Direction.LOAD else (device_rows, host)
        finished = threading.Event()
        copy = RowCopy(src, Rows.of(range(rows)), dst, Rows.of(range(rows)))
        cuda.submit_walk(direction, [[(copy, 0)]], lambda e, f=finished: f.set())
        assert finished.wait(WAIT_S)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - before
    assert grown < cuda.staging_bytes, f"{grown} bytes allocated for a strided run"
    assert torch.equal(device_rows.cpu(), host)


def thread_cpu_s(native_id: int) -> float:
    """A thread's user + system CPU seconds, from /proc (any thread of this process)."""
    import os

    with open(f"/proc/self/task/{native_id}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@gpu
def test_on_a_device_the_completion_thread_sleeps_through_a_long_copy(cuda: Any) -> None:
    """A walk behind about 2 s of GPU work: its completion thread waits the whole time and
    must spend a small part of it on a CPU (a spinning `synchronize` spends all of it)."""
    torch.cuda.synchronize()
    with torch.cuda.stream(cuda.load_stream):
        gpu_sleep(2.0)
    thread = cuda._completions[Direction.LOAD].thread
    assert thread.native_id is not None
    cpu_before, wall_before = thread_cpu_s(thread.native_id), time.monotonic()
    finished = threading.Event()
    load = rows_copy(cuda, Direction.LOAD)
    cuda.submit_walk(Direction.LOAD, [[(load, 0)]], lambda e: finished.set())
    assert finished.wait(WAIT_S)
    waited_s = time.monotonic() - wall_before
    spent_s = thread_cpu_s(thread.native_id) - cpu_before
    assert waited_s > 0.5, f"the GPU work took {waited_s:.2f}s: too short to judge"
    assert spent_s < 0.25 * waited_s, f"{spent_s:.2f} CPU s over {waited_s:.2f} s of waiting"
