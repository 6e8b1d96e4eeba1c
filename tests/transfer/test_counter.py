"""The layer-done counter and its ring: release on completion, protocol errors, failures."""

from __future__ import annotations

import threading

import pytest
import torch

from hicache.errors import CounterMisuseError, TransferError
from hicache.memory import DevicePool, GroupGeometry, HostPool
from hicache.model import CacheGroup, CacheKind, CacheSpec, KvFormat
from hicache.transfer import (
    NOOP_COUNTER,
    READY,
    CancelToken,
    CopyCancelled,
    CounterRing,
    CpuCopyBackend,
    Direction,
    GroupMove,
    RowCopy,
    Rows,
    copy_layers_blocking,
)
from hicache.transfer.cpu_backend import WalkProgress


def test_wait_returns_when_the_layer_lands_not_before() -> None:
    ring = CounterRing(2)
    counter = ring.acquire(load_id=1, num_layers=3)
    progress = WalkProgress()
    counter.submitted(progress)
    released = threading.Event()

    def consumer() -> None:
        counter.wait_layer(1)
        released.set()

    thread = threading.Thread(target=consumer)
    thread.start()
    progress.advance(1)  # layer 0 landed; the consumer waits for layer 1
    assert not released.wait(0.05)
    progress.advance(2)  # layer 1 landed
    assert released.wait(5)
    thread.join()
    progress.advance(3)
    ring.release(counter)
    counter.wait_layer(2)  # released after completion: returns at once


def test_protocol_errors() -> None:
    ring = CounterRing(2)
    a = ring.acquire(7, 4)
    with pytest.raises(
        CounterMisuseError, match=r"^load 7: layer 2 was never submitted; every layer "
    ):
        a.wait_layer(2)
    with pytest.raises(
        CounterMisuseError, match=r"^load 7: layer index 4 is outside 0\.\.3 \(stage-local "
    ):
        a.wait_layer(4)
    a.submitted(WalkProgress())
    with pytest.raises(CounterMisuseError, match=r"^load 7: walk submitted twice$"):
        a.submitted(READY)
    b = ring.acquire(8, 1)
    with pytest.raises(
        CounterMisuseError,
        match=r"^counter ring of 2 slots is full \(loads \[7, 8\] in flight\); finish one before "
        r"starting another, or raise scheduler\.counter_ring_size$",
    ):
        ring.acquire(9, 1)
    ring.release(a)  # its walk never completed
    with pytest.raises(
        CounterMisuseError,
        match=r"^load 7's counter was released before its walk completed \(slot 0 of the ring ",
    ):
        a.wait_layer(0)
    with pytest.raises(
        CounterMisuseError, match=r"^load 7's counter is not in slot 0; it was released already$"
    ):
        ring.release(a)
    with pytest.raises(
        CounterMisuseError, match=r"^load 7: walk submitted after the counter was released$"
    ):
        a.submitted(READY)
    c = ring.acquire(9, 1)  # the freed slot serves again
    assert c.slot == 0
    assert ring.in_flight == 2
    ring.release(b)
    ring.release(c)
    NOOP_COUNTER.wait_layer(123)  # never blocks, never raises


def test_failed_layer_reports_through_done_and_worker_survives() -> None:
    backend = CpuCopyBackend()
    try:
        src = torch.zeros(4, 8, dtype=torch.uint8)
        dst = torch.zeros(4, 8, dtype=torch.uint8)
        src.fill_(3)
        good = RowCopy(src, Rows.of([0]), dst, Rows.of([3]))
        bad = RowCopy(src, Rows.of([0, 1]), dst, Rows.of([2]))  # mismatched counts
        reported: list[dict[int, BaseException]] = []
        finished = threading.Event()

        def done(errors: dict[int, BaseException]) -> None:
            reported.append(errors)
            finished.set()

        walk = backend.submit_walk(Direction.LOAD, [[(good, 0)], [], [(bad, 0)]], done)
        assert finished.wait(5)
        assert not walk.all_done(3)  # layer 2 never landed: the walk stopped there
        assert walk.failure is not None
        assert walk.failure.position == 2
        assert list(reported[0]) == [2]
        assert "2 source rows but 1 destination rows" in str(reported[0][2])
        assert int(dst[3].min()) == 3  # the good layer landed
        finished.clear()
        again = RowCopy(src, Rows.of([1]), dst, Rows.of([0]))
        backend.submit_walk(Direction.LOAD, [[(again, 0)]], done)
        assert finished.wait(5)
        assert reported[1] == {}
        assert int(dst[0].min()) == 3
    finally:
        backend.close()
    with pytest.raises(
        TransferError, match=r"^the CPU copy backend is closed; no new copies are accepted$"
    ):
        backend.submit_walk(Direction.LOAD, [], lambda e: None)


def test_cancelled_walk_skips_layers_not_started() -> None:
    backend = CpuCopyBackend()
    try:
        src = torch.ones(2, 8, dtype=torch.uint8)
        dst = torch.zeros(2, 8, dtype=torch.uint8)
        token = CancelToken()
        token.cancel()
        reported: list[dict[int, BaseException]] = []
        finished = threading.Event()
        backend.submit_walk(
            Direction.LOAD,
            [[(RowCopy(src, Rows.of([0]), dst, Rows.of([1])), 0)]],
            lambda e: (reported.append(e), finished.set()),
            cancel=token,
        )
        assert finished.wait(5)
        assert isinstance(reported[0][0], CopyCancelled)
        assert int(dst.max()) == 0
    finally:
        backend.close()


def test_group_move_validates_pages() -> None:
    backend = CpuCopyBackend()
    try:
        spec = CacheSpec(CacheKind.FULL, KvFormat.MHA, num_kv_heads=1, head_dim=4, v_head_dim=4)
        g = GroupGeometry(CacheGroup("full", spec, (0,)), torch.float16, 2)
        device = DevicePool.allocate(g, 4)
        host = HostPool(g, 3, "layer_first", backend.alloc_host(3 * g.page_bytes))
        with pytest.raises(
            TransferError, match=r"^group 'full': 2 device pages but 1 host pages; "
        ):
            GroupMove.build(backend, device, host, [0, 1], [0])
        with pytest.raises(TransferError, match=r"^group 'full': host page 3 is outside 0\.\.2$"):
            GroupMove.build(backend, device, host, [0], [3])
        with pytest.raises(TransferError, match=r"^group 'full': a device page is listed twice$"):
            GroupMove.build(backend, device, host, [1, 1], [0, 1])
        copy_layers_blocking(backend, Direction.LOAD, [])
    finally:
        backend.close()
