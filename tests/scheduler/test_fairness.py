"""Per-engine fairness of the walk queues: one attachment's backlog delays another's queued
walk by at most one walk per other attachment with walks of that kind queued
(`walk_queue.py`'s bound), counted in walks, never in time."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from hicache.scheduler import DEFAULT_ATTACHMENT, GroupPages, OpKind, OpState
from hicache.scheduler.records import OpRecord, WalkBatch
from hicache.scheduler.walk_queue import WalkQueue
from hicache.testing.fake_copies import FakeCopyBackend
from hicache.transfer import LayerFailure
from tests.scheduler.conftest import PAGE, gate_opened_on_exit, stack
from tests.scheduler.test_attachments import MODEL, other_pools, until

DEEP = 7  # the busy engine's attachment
DEEP_LOADS = 8


def _op(op_id: int, attachment: int) -> OpRecord:
    loop = asyncio.get_running_loop()
    return OpRecord(
        op_id,
        OpKind.LOAD,
        {},
        0.0,
        loop.create_future(),
        loop.create_future(),
        attachment=attachment,
    )


def _order(queue: WalkQueue) -> list[int]:
    """Attachments in the order their batches start, one walk in flight at a time."""
    order = []
    while (batch := queue.next_ready()) is not None:
        order.append(batch.attachment)
        queue.walk_ended(batch)
    return order


@pytest.mark.asyncio
async def test_the_queue_serves_attachments_in_turn() -> None:
    queue = WalkQueue(
        depth=64, inflight_bytes=1 << 30, counter_ring_size=1, backup_walks_in_flight=1
    )
    for i in range(6):
        queue.append(WalkBatch(OpKind.LOAD, [_op(i, 1)]))
    queue.append(WalkBatch(OpKind.LOAD, [_op(10, 2)]))
    queue.append(WalkBatch(OpKind.LOAD, [_op(11, 3)]))
    queue.append(WalkBatch(OpKind.LOAD, [_op(12, 3)]))
    # three attachments queued: each one's head starts after at most two other walks
    assert _order(queue) == [1, 2, 3, 1, 3, 1, 1, 1, 1]


@pytest.mark.asyncio
async def test_a_batch_cancelled_while_queued_gives_up_its_turn() -> None:
    queue = WalkQueue(
        depth=64, inflight_bytes=1 << 30, counter_ring_size=1, backup_walks_in_flight=1
    )
    cancelled = _op(0, 1)
    queue.append(WalkBatch(OpKind.LOAD, [cancelled]))
    queue.append(WalkBatch(OpKind.LOAD, [_op(1, 2)]))
    cancelled.state = OpState.CANCELLED
    queue.left(cancelled)
    assert _order(queue) == [2]
    assert queue.queued(OpKind.LOAD) == 0


@pytest.mark.asyncio
async def test_a_deep_backlog_delays_a_quiet_engines_load_by_one_walk() -> None:
    """Engine DEEP queues DEEP_LOADS loads; the quiet engine (the default attachment) then
    queues one. One load walk runs at a time (one counter slot), so the walks' order is the
    dispatch order: of DEEP's walks, only the one in flight when the quiet load was queued
    and at most one more (N - 1 = 1 other attachment) start before it."""
    backend = FakeCopyBackend()
    with stack(MODEL, backend=backend, counter_ring_size=1) as cache, gate_opened_on_exit(backend):
        deep_pools = other_pools(cache, 8, 0x5A)
        async with cache.scheduler.running() as sched:
            sched.attach_device_pools(deep_pools, attachment=DEEP)
            backup = await (await sched.backup(_pages(cache, [1, 2]))).done()
            assert backup.state is OpState.DONE, backup.error
            hosts = {n: g.host_pages for n, g in backup.groups.items()}
            started: list[int] = []
            lock = threading.Lock()

            def first_layer(attachment: int) -> Callable[[int, LayerFailure | None], None]:
                def heard(upto: int, failure: LayerFailure | None) -> None:
                    if upto == 1 and failure is None:
                        with lock:
                            started.append(attachment)

                return heard

            async def load(attachment: int) -> None:
                handles = await sched.load_step(
                    [_pages(cache, [5, 6], hosts)],
                    attachment=attachment,
                    on_layer=first_layer(attachment),
                )
                result = await handles[0].done()
                assert result.state is OpState.DONE, result.error

            backend.close_gate()
            deep = [asyncio.create_task(load(DEEP)) for _ in range(DEEP_LOADS)]
            await until(lambda: sched.stats().queued_loads == DEEP_LOADS - 1)
            quiet = asyncio.create_task(load(DEFAULT_ATTACHMENT))
            await until(lambda: sched.stats().queued_loads == DEEP_LOADS)
            backend.open_gate()
            await asyncio.gather(*deep, quiet)
    assert sorted(started) == sorted([DEEP] * DEEP_LOADS + [DEFAULT_ATTACHMENT])
    ahead = started.index(DEFAULT_ATTACHMENT)
    # one DEEP walk was in flight when the quiet load was queued; the bound allows one more
    assert ahead <= 2, started


def _pages(cache, pages, hosts=None):  # type: ignore[no-untyped-def]
    out = {}
    for name in cache.geometries:
        if hosts is None:
            out[name] = GroupPages(tuple(pages))
        else:
            out[name] = GroupPages(tuple(pages), hosts[name], num_tokens=len(pages) * PAGE)
    return out
