"""A layer whose copy failed (or whose walk was cancelled) is never reported as landed: the
backends stop the walk there, the counter returns the stop, and the embedded handle's
`wait_layer` raises `LayerLoadError` for that layer and every later one, before the op ends,
while the layers that landed first still return. The op still ends once, with its pins
released. CUDA: the same contract for a layer whose submission raised (marked `gpu`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch

from hicache.embedded import EmbeddedCache
from hicache.errors import LayerLoadError
from hicache.scheduler import GroupPages, OpResult, OpState
from hicache.scheduler.handle import OpHandle
from hicache.testing.fake_copies import FakeCopyBackend, InjectedFault
from hicache.transfer import (
    CancelToken,
    CopyBackend,
    CopyCancelled,
    CounterRing,
    CpuCopyBackend,
    Direction,
    LayerFailure,
    RowCopy,
    Rows,
    StopKind,
    StoppedCounter,
)
from hicache.transfer.cpu_backend import WalkProgress
from tests.scheduler.conftest import assert_pinned_none, gate_opened_on_exit, pages_for, stack

MODEL = "falcon_h1_7b.json"  # every layer owns an attention and a Mamba cache
FAULT = r"InjectedFault: injected fault at layer position"

# ---- the backends ------------------------------------------------------------------------


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest) -> Iterator[CopyBackend]:
    if request.param == "cuda":
        from hicache.transfer.cuda_backend import CudaCopyBackend

        made: CopyBackend = CudaCopyBackend()
    else:
        made = CpuCopyBackend()
    try:
        yield made
    finally:
        made.close()


def test_a_failed_layer_stops_the_walk_and_never_counts_as_landed(backend: CopyBackend) -> None:
    device = backend.device
    src = torch.full((4, 8), 7, dtype=torch.uint8)  # host rows
    if backend.pins_host_memory:
        src = src.pin_memory()
    dst = torch.zeros(4, 8, dtype=torch.uint8, device=device)
    good = [
        RowCopy(src, backend.rows([i], "host"), dst, backend.rows([i], "device")) for i in range(4)
    ]
    bad = RowCopy(src, backend.rows([0, 1], "host"), dst, backend.rows([2], "device"))  # 2 into 1
    heard: list[tuple[int, LayerFailure | None]] = []
    reported: list[dict[int, BaseException]] = []
    finished = threading.Event()

    def done(errors: dict[int, BaseException]) -> None:
        reported.append(errors)
        finished.set()

    walk = backend.submit_walk(
        Direction.LOAD,
        [[(good[0], 0)], [], [(bad, 0)], [(good[3], 0)]],
        done,
        on_layer=lambda upto, stopped: heard.append((upto, stopped)),
    )
    assert finished.wait(10)
    if device.type == "cuda":
        torch.cuda.synchronize()
    stop = walk.failure
    assert stop is not None
    assert (stop.position, stop.kind) == (2, StopKind.FAILED_LAYER)
    assert stop.reason == "ValueError: 2 source rows but 1 destination rows"
    assert walk.wait(0) is None
    assert walk.wait(1) is None
    assert walk.wait(2) == stop
    assert walk.wait(3) == stop
    assert [walk.is_done(i) for i in range(4)] == [True, True, False, False]
    assert heard == [(1, None), (2, None), (2, stop)]  # the stop is heard, once, last
    assert list(reported[0]) == [2, 3]
    assert isinstance(reported[0][3], CopyCancelled)
    assert str(reported[0][3]).startswith("layer position 3: skipped, the walk stopped at ")
    assert int(dst[0].min()) == 7  # layer 0 landed
    assert int(dst[3].max()) == 0  # layer 3 was never copied


def test_cancelled_walk_stops_at_the_layer_it_had_not_started() -> None:
    backend = FakeCopyBackend(gated=True)
    try:
        src = torch.full((3, 8), 5, dtype=torch.uint8)
        dst = torch.zeros(3, 8, dtype=torch.uint8)
        copies = [[(RowCopy(src, Rows.of([i]), dst, Rows.of([i])), 0)] for i in range(3)]
        token = CancelToken()
        finished = threading.Event()
        walk = backend.submit_walk(Direction.LOAD, copies, lambda e: finished.set(), cancel=token)
        backend.release(1)  # layer 0 runs; layer 1 waits at the gate, before its cancel check
        assert walk.wait(0) is None
        token.cancel()
        backend.open_gate()
        assert finished.wait(5)
        assert walk.wait(1) == LayerFailure(1, StopKind.CANCELLED, "cancelled")
        assert walk.wait(2) == walk.failure
        assert int(dst[0].min()) == 5
        assert int(dst[1:].max()) == 0
    finally:
        backend.close()


def test_the_counter_keeps_the_stop_after_release() -> None:
    ring = CounterRing(1)
    counter = ring.acquire(load_id=3, num_layers=4)
    progress = WalkProgress()
    counter.submitted(progress)
    stop = LayerFailure(2, StopKind.FAILED_LAYER, "InjectedFault: boom")
    got: list[LayerFailure | None] = []
    waiter = threading.Thread(target=lambda: got.append(counter.wait_layer(3)))
    waiter.start()
    progress.advance(2)
    progress.stop(stop)  # wakes a consumer waiting on a later layer
    waiter.join(5)
    assert got == [stop]
    ring.release(counter)
    assert [counter.wait_layer(i) for i in range(4)] == [None, None, stop, stop]
    assert StoppedCounter(stop).wait_layer(1) is None
    assert StoppedCounter(stop).wait_layer(2) == stop


def test_the_failure_names_the_cause_per_layer() -> None:
    stop = LayerFailure.of(4, InjectedFault("injected fault at layer position 4"))
    assert stop.cause(9, 9) == "InjectedFault: injected fault at layer position 4"
    assert stop.cause(11, 9) == (
        "layer 9 failed first (InjectedFault: injected fault at layer position 4)"
    )
    cancelled = LayerFailure.of(4, CopyCancelled("layer position 4: walk cancelled"))
    assert cancelled.cause(11, 9) == "cancelled"


# ---- the embedded handle -----------------------------------------------------------------


async def stored(cache: EmbeddedCache) -> dict[str, GroupPages]:
    """Back up device pages 1, 2 (+ state slot 1); a load request of them into 5, 6 (+ 2)."""
    backup = await (await cache.scheduler.backup(pages_for(cache, [1, 2], 1))).done()
    assert backup.state is OpState.DONE
    moved = {n: g.host_pages for n, g in backup.groups.items()}
    dest = pages_for(cache, [5, 6], 2)
    return {n: GroupPages(dest[n].device_pages, moved[n]) for n in dest}


def layer_bytes(cache: EmbeddedCache, layer_id: int, pages: dict[str, GroupPages]) -> bytes:
    out = b""
    for slot in cache.layer_map.slots(layer_id):
        pool = cache.device_pools[slot.group.name]
        for tensor, _ in pool.geometry.tensors:
            rows = pool.rows(slot.local_id, tensor)
            for page in pages[slot.group.name].device_pages:
                out += rows[page].numpy().tobytes()
    return out


def done_once(handle: OpHandle) -> list[OpResult]:
    results: list[OpResult] = []
    handle.add_done_callback(results.append)
    return results


@pytest.mark.asyncio
async def test_wait_layer_raises_for_a_failed_layer_before_the_load_ends() -> None:
    backend = FakeCopyBackend()
    with stack(MODEL, backend=backend) as cache:
        async with cache.scheduler.running() as sched:
            request = await stored(cache)
            source = {n: GroupPages(pages_for(cache, [1, 2], 1)[n].device_pages) for n in request}
            before = {i: layer_bytes(cache, i, request) for i in (0, 1, 2, 3)}
            backend.fail_next({2})
            handle = await sched.load(request)
            results = done_once(handle)
            # on the loop thread on purpose: the op cannot end (nor the walk report) meanwhile
            handle.wait_layer(0)
            handle.wait_layer(1)
            load = handle.op_id
            with pytest.raises(
                LayerLoadError,
                match=rf"^load {load}: layer 2 did not land: {FAULT} 2$",
            ) as info:
                handle.wait_layer(2)
            assert handle.state is OpState.RUNNING  # told before the load ended
            assert (info.value.load_id, info.value.layer_id) == (load, 2)
            with pytest.raises(
                LayerLoadError,
                match=rf"^load {load}: layer 3 did not land: layer 2 failed first \({FAULT} 2\)$",
            ):
                handle.wait_layer(3)
            result = await handle.done()
            assert result.state is OpState.FAILED
            assert result.error == "InjectedFault: injected fault at layer position 2"
            await asyncio.sleep(0.01)
            assert results == [result]  # the end is reported once
            # after the end the handle still answers the same way
            handle.wait_layer(1)
            with pytest.raises(LayerLoadError, match=rf"^load {load}: layer 2 did not land: "):
                handle.wait_layer(2)
            # what landed is the source's bytes; what did not was never written
            for i in (0, 1):
                assert layer_bytes(cache, i, request) == layer_bytes(cache, i, source)
            for i in (2, 3):
                assert layer_bytes(cache, i, request) == before[i]
            assert backend.layers_run == 2 + len(cache.layer_map.stage_layer_ids)  # + backup
            # the next load is whole
            again = await sched.load(request)
            for i in range(4):
                await asyncio.to_thread(again.wait_layer, i)
            assert (await again.done()).state is OpState.DONE
        assert_pinned_none(cache)


@pytest.mark.asyncio
async def test_a_pipeline_stage_names_global_layer_ids() -> None:
    backend = FakeCopyBackend()
    with stack(MODEL, backend=backend, start=4, end=12) as cache:
        async with cache.scheduler.running() as sched:
            request = await stored(cache)
            backend.fail_next({1})  # stage position 1 is global layer 5
            handle = await sched.load(request)
            handle.wait_layer(4)
            load = handle.op_id
            with pytest.raises(
                LayerLoadError, match=rf"^load {load}: layer 5 did not land: {FAULT} 1$"
            ):
                handle.wait_layer(5)
            with pytest.raises(
                LayerLoadError,
                match=rf"^load {load}: layer 11 did not land: layer 5 failed first \({FAULT} 1\)$",
            ):
                handle.wait_layer(11)
            assert (await handle.done()).state is OpState.FAILED
        assert_pinned_none(cache)


@pytest.mark.asyncio
async def test_wait_layer_raises_for_the_layers_of_a_cancelled_load() -> None:
    backend = FakeCopyBackend(gated=True)
    with stack(MODEL, backend=backend) as cache:
        async with cache.scheduler.running() as sched:
            with gate_opened_on_exit(backend):
                backend.open_gate()
                request = await stored(cache)
                backend.close_gate()
                handle = await sched.load(request)
                results = done_once(handle)
                backend.release(2)  # layers 0 and 1 land; layer 2 waits at the gate
                await asyncio.to_thread(handle.wait_layer, 1)
                handle.cancel()
                backend.open_gate()  # layer 2 meets the cancelled token: skipped
                load = handle.op_id
                with pytest.raises(
                    LayerLoadError, match=rf"^load {load}: layer 2 did not land: cancelled$"
                ):
                    await asyncio.to_thread(handle.wait_layer, 2)
                with pytest.raises(
                    LayerLoadError, match=rf"^load {load}: layer 30 did not land: cancelled$"
                ):
                    await asyncio.to_thread(handle.wait_layer, 30)
                handle.wait_layer(0)
                result = await handle.done()
                assert result.state is OpState.CANCELLED
                await asyncio.sleep(0.01)
                assert results == [result]
        assert_pinned_none(cache)


@pytest.mark.asyncio
async def test_a_load_that_ended_before_its_walk_ran_raises_too() -> None:
    backend = FakeCopyBackend(gated=True)
    with stack(MODEL, backend=backend, counter_ring_size=1) as cache:
        async with cache.scheduler.running() as sched:
            with gate_opened_on_exit(backend):
                backend.open_gate()
                request = await stored(cache)
                backend.close_gate()
                first = await sched.load(request)  # holds the only counter slot, gated
                # queued behind it until its deadline passes: it never runs
                late = await sched.load(request, deadline_s=0.05)
                assert late.state is OpState.EXPIRED
                with pytest.raises(
                    LayerLoadError,
                    match=rf"^load {late.op_id}: layer 0 did not land: deadline passed while "
                    r"queued$",
                ):
                    late.wait_layer(0)
                backend.open_gate()
                await asyncio.to_thread(first.wait_layer, 43)
                assert (await first.done()).state is OpState.DONE
        assert_pinned_none(cache)
