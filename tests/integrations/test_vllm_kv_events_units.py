"""The connector's KV events (`hicache/integrations/vllm/kv_events.py`) without an engine:
which blocks a store's reply reports per medium, how the scheduler waits for every
tensor-parallel rank and coalesces, the bounds, and that the step book carries vLLM's
hashes of exactly the pages a store moves. The real channel: test_vllm_kv_events.py."""

from __future__ import annotations

import os

import pytest

if not os.environ.get("_HICACHE_REQUIRE_VLLM"):
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (python3 dev.py setup)")

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from hicache.integrations.vllm.kv_events import (
    HicacheKvEvents,
    SchedulerEvents,
    WorkerEvents,
    events_enabled,
)
from hicache.integrations.vllm.plan import Scheduled, StepBook, StoreJob

PAGE = 2
HASHES = tuple(bytes([i]) * 32 for i in range(6))


def ext(i: int) -> object:
    return maybe_convert_block_hash(BlockHash(HASHES[i]))


def job(first_page: int, pages: int) -> StoreJob:
    """A store of pages [first_page, first_page + pages) of a prompt 0, 1, 2, ..."""
    end = first_page + pages
    return StoreJob(
        "r",
        tuple(range(end * PAGE)),
        first_page,
        ((1,) * end,),
        end * PAGE,
        HASHES[first_page:end],
        HASHES[first_page - 1] if first_page else None,
    )


def stored(events: list[object]) -> list[tuple[str, list[object], object, list[int]]]:
    out = []
    for e in events:
        assert isinstance(e, BlockStored)
        assert e.medium is not None
        out.append((e.medium, e.block_hashes, e.parent_block_hash, e.token_ids))
    return out


def test_a_reply_reports_the_pages_l2_holds_and_l3_when_persisted() -> None:
    worker = WorkerEvents(PAGE)
    worker.answered(job(1, 3), {})  # pages 1..3 in L2
    worker.answered(job(1, 3), {"truncated_to_tokens": 3 * PAGE, "persisted": True})
    worker.answered(job(2, 2), {"truncated_to_tokens": PAGE})  # L2 kept none of its pages
    worker.answered(StoreJob("r", (0, 1), 0, ((1,),), 2), {})  # no hashes: events off
    taken = worker.take()
    assert taken is not None
    assert stored(taken.get_all_events()) == [
        ("CPU", [ext(1), ext(2), ext(3)], ext(0), [2, 3, 4, 5, 6, 7]),
        ("CPU", [ext(1), ext(2)], ext(0), [2, 3, 4, 5]),  # the prefix L2 took
        ("STORAGE", [ext(1), ext(2)], ext(0), [2, 3, 4, 5]),
    ]
    assert worker.take() is None  # handed over once


def test_a_worker_keeps_at_most_its_limit_and_counts_the_rest() -> None:
    worker = WorkerEvents(PAGE, limit=2)
    worker.answered(job(0, 1), {"persisted": True})
    worker.answered(job(1, 1), {})
    assert worker.dropped == 1
    taken = worker.take()
    assert taken is not None
    assert len(taken.get_all_events()) == 2


def test_the_scheduler_publishes_a_block_once_every_rank_holds_it_coalesced() -> None:
    rank0, rank1 = WorkerEvents(PAGE), WorkerEvents(PAGE)
    rank0.answered(job(0, 3), {})
    rank1.answered(job(0, 3), {"truncated_to_tokens": 2 * PAGE})  # rank 1 kept 2 pages
    first, second = rank0.take(), rank1.take()
    assert first is not None
    assert second is not None
    alone = SchedulerEvents(tp_size=2)
    alone.add(HicacheKvEvents(list(first.get_all_events())))
    assert alone.take() == []  # one rank so far
    first.add_events(second.get_all_events())  # as vLLM merges the ranks' outputs
    first.increment_workers()
    scheduler = SchedulerEvents(tp_size=2)
    scheduler.add(first)
    assert stored(scheduler.take()) == [("CPU", [ext(0), ext(1)], None, [0, 1, 2, 3])]
    rank1.answered(job(2, 1), {})  # rank 1 stores page 2 later: now both hold it
    later = rank1.take()
    assert later is not None
    scheduler.add(later)
    assert stored(scheduler.take()) == [("CPU", [ext(2)], ext(1), [4, 5])]


def test_the_scheduler_drops_the_oldest_waiting_block_past_its_limit() -> None:
    scheduler = SchedulerEvents(tp_size=2, limit=2)
    worker = WorkerEvents(PAGE)
    worker.answered(job(0, 3), {})
    taken = worker.take()
    assert taken is not None
    scheduler.add(taken)
    assert scheduler.dropped == 1
    scheduler.add(HicacheKvEvents(list(taken.get_all_events())))  # the other rank
    # block 0 was dropped while waiting: reported once more, it waits again
    assert stored(scheduler.take()) == [("CPU", [ext(1), ext(2)], ext(0), [2, 3, 4, 5])]


def test_the_step_book_carries_vllms_hashes_of_the_pages_a_store_moves() -> None:
    book = StepBook(PAGE, lambda tokens: (0, 0))
    tokens = list(range(3 * PAGE))
    [first] = book.step([Scheduled("r", tokens, 0, 2 * PAGE, [[1, 2, 3]], HASHES[:3])]).stores
    assert (first.block_hashes, first.parent_hash) == (HASHES[:2], None)
    [second] = book.step([Scheduled("r", tokens, 2 * PAGE, PAGE, [[1, 2, 3]], HASHES[:3])]).stores
    assert (second.first_page, second.block_hashes, second.parent_hash) == (
        2,
        HASHES[2:3],
        HASHES[1],
    )
    # vLLM hashed fewer pages than the store moves (or events are off): no hashes sent
    [bare] = book.step([Scheduled("s", tokens, 0, 3 * PAGE, [[4, 5, 6]], HASHES[:2])]).stores
    assert (bare.block_hashes, bare.parent_hash) == ((), None)


class _Config:
    def __init__(self, enabled: bool | None):
        self.kv_events_config = None if enabled is None else _Events(enabled)


class _Events:
    def __init__(self, enabled: bool):
        self.enable_kv_cache_events = enabled


def test_events_are_on_only_when_vllm_publishes_them_for_a_one_group_model() -> None:
    assert events_enabled(_Config(True), 1)
    assert not events_enabled(_Config(False), 1)
    assert not events_enabled(_Config(None), 1)
    assert not events_enabled(_Config(True), 2)  # a hybrid's groups: not reported


def test_a_worker_harvests_answered_stores_without_waiting_for_the_others() -> None:
    """`get_kv_connector_kv_cache_events` takes the stores already answered; one still in
    flight is reported once its reply is in, never waited for."""
    import threading

    from tests.integrations.test_vllm_units import _worker

    worker, client = _worker(staging_pages=4, direct=True)
    events = WorkerEvents(16)
    worker.stores._on_answered = events.answered  # as the connector wires it
    hashes = tuple(bytes([i]) * 32 for i in range(4))
    worker.store([StoreJob("a", tuple(range(64)), 3, ((5, 6, 7, 2),), 64, hashes[3:], hashes[2])])
    worker.before_forward()  # its reply taken
    client.store_gate = threading.Event()  # the next store's reply is held
    worker.store([StoreJob("b", tuple(range(32)), 0, ((1, 2),), 32, hashes[:2], None)])
    assert client.store_entered.wait(30)
    worker.harvest_stores()  # returns at once: "b" still in flight
    taken = events.take()
    assert taken is not None
    assert stored(taken.get_all_events()) == [
        (
            "CPU",
            [maybe_convert_block_hash(BlockHash(hashes[3]))],
            maybe_convert_block_hash(BlockHash(hashes[2])),
            list(range(48, 64)),
        ),
    ]
    client.store_gate.set()
    [(_job, reply)] = worker.stores._in_flight
    reply.result(timeout=30)  # its reply is in: the next harvest takes it, no drain needed
    worker.harvest_stores()
    assert worker.stores._in_flight == []
    later = events.take()
    assert later is not None
    assert (
        [e.block_hashes for e in later.get_all_events()]
        == [  # type: ignore[attr-defined]
            [maybe_convert_block_hash(BlockHash(h)) for h in hashes[:2]]
        ]
    )
    worker.close()
