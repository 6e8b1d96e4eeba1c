"""An engine adapter's load that outlives its timeout (review F3), against a real `hicache serve`
whose loads are slow (the test-only copy faults: 0.1 s before each of the 16 layers): the load
is cancelled and waited for, or its session detached, before the adapter hands the memory back
to its engine, so no copy of it lands in memory the engine reuses (`core.load_end`,
`SidecarLink.detach`).

What is judged: the destination pages, overwritten with a marker as soon as the call returned
(the engine reusing them), keep the marker once the load is over for certain (its handle's end,
or a later load of the new session run whole); and the sidecar holds no pin or unreleased load
afterwards. The orderings:
a load that ends in time (no cancel), one that ends once cancelled, one whose session is
detached while it runs."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.channel.counters import CounterFile, LoadState
from hicache.channel.shm import SharedPools
from hicache.client import Client, LoadHandle, connect
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from hicache.integrations.core.load_end import end_load
from hicache.integrations.core.sidecar_link import SidecarLink
from tests.service.conftest import write_config
from tests.service.test_layer_failure import layer_pages, served, settled, stored_prompt

LAYERS = 16
MARK = 0xAB
TARGET = {"full": [8, 9, 10], "conv": [8]}
LATER = {"full": [11, 12, 13], "conv": [11]}


@pytest.fixture
def slow(tmp_path: Path) -> Iterator[tuple[SidecarProcess, Path]]:
    yield from served(tmp_path, {"load_layer_delay_s": 0.1})  # a load: >= 1.6 s


def mark(pools: SharedPools, target: dict[str, list[int]]) -> None:
    """The engine reuses the pages: every layer's rows of `target` overwritten."""
    for name, pool in pools.device_pools().items():
        for local in range(pool.geometry.num_layers):
            for tensor, _ in pool.geometry.tensors:
                rows = pool.rows(local, tensor)
                for page in target[name]:
                    rows[page].fill_(MARK)


def marked(client: Client, pools: SharedPools) -> list[int]:
    """The layers whose target pages no longer hold the marker (a late copy landed)."""
    return [
        layer
        for layer in range(LAYERS)
        if set(layer_pages(client, pools, layer, TARGET["full"])) != {MARK}
    ]


def test_a_cancelled_load_has_ended_once_its_slot_is_freed_or_reused(tmp_path: Path) -> None:
    """The client half on its own, against a counter file written as the sidecar writes it:
    a load released while running gets its final state and FREE back to back the moment it
    ends (`ops_data`: `finished` frees a released load's slot), so `done()` may never see the
    final state; a freed slot, or one already serving the next load, means it ended."""
    layer_map = load_deployment(write_config(tmp_path)).layer_map()
    counters = CounterFile.create(2)
    ends: list[int] = []  # loads whose walk ends as soon as the release is read

    def release(load_id: int) -> None:
        slot = 1 if load_id == 7 else 0
        if load_id in ends:
            counters.end(slot, LoadState.CANCELLED, "cancelled")
            counters.array[slot][2] = LoadState.FREE
            if load_id == 8:
                counters.start(slot, 9, num_layers=16)  # the slot serves the next load

    def started(load_id: int, slot: int) -> LoadHandle:
        counters.start(slot, load_id, num_layers=16)
        reply = {"load_id": load_id, "slot": slot, "tokens": 32, "failed": {}}
        return LoadHandle(release, layer_map, counters, 1, lambda: 1, reply, [])

    running = started(6, 0)
    running.cancel()  # released, its walk not ended yet: still running
    assert running.state() == "running"
    counters.end(0, LoadState.CANCELLED, "cancelled")  # then it ends
    assert running.done(timeout_s=60) == "cancelled"  # 60 s: bounds a hang only
    ends.extend([7, 8])
    freed = started(7, 1)
    freed.cancel()
    assert freed.done(timeout_s=60) == "cancelled"
    reused = started(8, 0)
    reused.cancel()
    assert reused.done(timeout_s=60) == "cancelled"


def test_a_load_that_ends_in_time_is_not_cancelled(slow: tuple[SidecarProcess, Path]) -> None:
    proc, config = slow
    client, pools, tokens = stored_prompt(proc, config)
    try:
        handle = client.load(tokens, TARGET)
        assert handle is not None
        assert end_load(handle, timeout_s=60, cancel_wait_s=60) == "done"
        for layer in range(LAYERS):
            assert layer_pages(client, pools, layer, TARGET["full"]) == layer_pages(
                client, pools, layer, [0, 1, 2]
            )
        settled(proc)
    finally:
        client.close()


def test_a_load_past_its_timeout_is_cancelled_and_ended_before_the_memory_is_back(
    slow: tuple[SidecarProcess, Path],
) -> None:
    proc, config = slow
    client, pools, tokens = stored_prompt(proc, config)
    try:
        handle = client.load(tokens, TARGET)
        assert handle is not None
        state = end_load(handle, timeout_s=0.05, cancel_wait_s=60)  # 0.05 s < one layer
        mark(pools, TARGET)  # the engine reuses the pages at once
        final = handle.done(timeout_s=60)  # over for certain now
        assert marked(client, pools) == []  # no copy of it landed after end_load returned
        assert state == final == "cancelled"  # it had ended: its final state is kept
        settled(proc)
    finally:
        client.close()


def test_a_detached_session_s_load_is_over_once_the_link_attaches_again(
    slow: tuple[SidecarProcess, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A load that did not end even once cancelled (here: never cancelled, still running):
    `SidecarLink.detach` drops its session and attaches again; the sidecar registers the same
    memory only after the old session's copies settled, so True means none lands any more."""
    proc, config = slow
    first, pools, tokens = stored_prompt(proc, config)
    fd = os.dup(pools.fd)  # the memory outlives the first client (it closes its descriptor)
    layer_map = load_deployment(config).layer_map()
    clients = [first]

    def attach() -> Client:
        client = connect(proc.socket, layer_map, page_size_tokens=16, heartbeat=False)
        clients.append(client)
        return client

    def register(client: Client) -> None:  # the same memfd, as an adapter registers again
        client.register_pools(dataclasses.replace(pools, fd=os.dup(fd)))

    link = SidecarLink(
        lambda: first if link.counters.connects == 0 else attach(),
        lambda client: None if client is first else register(client),
        retry_after_s=0.2,
        name="test",
        log=logging.getLogger("hicache.test"),
    )
    try:
        client = link.client()
        assert client is first
        handle = client.load(tokens, TARGET)
        assert handle is not None
        with caplog.at_level(logging.WARNING, "hicache.test"):
            assert link.detach(client, "load did not end") is True
        assert "sidecar unavailable (load did not end)" in caplog.text
        mark(pools, TARGET)
        again = link.client()
        assert again is not None
        assert again is not first
        later = again.load(tokens, LATER)
        assert later is not None
        assert later.done(timeout_s=60) == "done"
        assert marked(first, pools) == []
        assert link.counters.connects == 2
    finally:
        link.close()
        for client in clients:
            client.close()
        os.close(fd)
