"""A layer that did not land reaches the engine over the sidecar: the copy thread writes the
stop (position, kind, cause) into the load's counter row at once, and the client's
`wait_layer` raises `LayerLoadError` for that layer and every later one, naming the load, the
global layer id and the cause, while the layers before it return. The sidecar runs with the
test-only copy faults (`python -m hicache.testing.serve --copy-faults`: a `FakeCopyBackend`
failing or slowing loads)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache.channel.counters import CounterFile, LoadState
from hicache.channel.shm import SharedPools
from hicache.client import Client, connect
from hicache.client.handle import LoadHandle
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from hicache.errors import LayerLoadError
from hicache.testing import serve as fault_serve
from hicache.transfer import LayerFailure, StopKind
from tests.pages import split_store
from tests.service.conftest import write_config

PAGE = 16
FAULT = r"InjectedFault: injected fault at layer position 2"


def served(tmp_path: Path, faults: dict[str, object]) -> Iterator[tuple[SidecarProcess, Path]]:
    config = write_config(tmp_path)
    proc = SidecarProcess(config, command=fault_serve.command(faults)).start()
    try:
        yield proc, config
    finally:
        assert proc.stop() == 0, config.with_suffix(".serve.log").read_text()


@pytest.fixture
def failing(tmp_path: Path) -> Iterator[tuple[SidecarProcess, Path]]:
    yield from served(tmp_path, {"fail_load_layers": [2]})  # layer 2: full attention


@pytest.fixture
def slow(tmp_path: Path) -> Iterator[tuple[SidecarProcess, Path]]:
    yield from served(tmp_path, {"load_layer_delay_s": 0.25})  # 16 layers: 4 s a load


def stored_prompt(proc: SidecarProcess, config: Path) -> tuple[Client, SharedPools, list[int]]:
    """A client with a registered pool whose 3-page prompt (pages 0..2, conv slot 0) is stored."""
    client = connect(
        proc.socket, load_deployment(config).layer_map(), page_size_tokens=PAGE, heartbeat=False
    )
    pools = client.create_pools(16)
    client.register_pools(pools)
    gen = torch.Generator().manual_seed(0)
    for pool in pools.device_pools().values():
        for layer in pool.tensors:
            for t in layer.values():
                t.view(-1)[: t.numel() // 4].copy_(torch.randn(t.numel() // 4, generator=gen))
    tokens = list(range(3 * PAGE))
    kinds = {n: g.group.kind for n, g in client.geometries.items()}
    client.store(tokens, *split_store(kinds, tokens, {"full": [0, 1, 2], "conv": [0]}, PAGE))
    return client, pools, tokens


def layer_pages(client: Client, pools: SharedPools, layer_id: int, full: list[int]) -> bytes:
    """Layer `layer_id`'s bytes in the given full pages (conv layers: the slot full[0])."""
    out = b""
    device = pools.device_pools()
    for slot in client.layer_map.slots(layer_id):
        pool = device[slot.group.name]
        pages = full if slot.group.kind.is_token_cache else full[:1]
        for tensor, _ in pool.geometry.tensors:
            rows = pool.rows(slot.local_id, tensor)
            out += b"".join(rows[p].numpy().tobytes() for p in pages)
    return out


def settled(proc: SidecarProcess) -> None:
    """The engine's releases are through and nothing is pinned."""
    deadline = time.monotonic() + 60  # bounds a hang only (#26: a busy machine)

    def unpinned(stats: dict) -> bool:  # type: ignore[type-arg]
        groups = stats["namespaces"][0]["groups"].values()
        return all(g["pinned_pages"] == 0 for g in groups)

    while True:  # the release is seen first, its pins go as the op ends: wait for both
        stats = proc.get_json("/v1/stats")
        released = not stats["sessions"][0]["loads_unreleased"]
        if (released and unpinned(stats)) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert stats["sessions"][0]["loads_unreleased"] == 0
    assert unpinned(stats), stats["namespaces"][0]["groups"]


def test_a_failed_layer_raises_in_wait_layer_over_the_sidecar(
    failing: tuple[SidecarProcess, Path],
) -> None:
    proc, config = failing
    client, pools, tokens = stored_prompt(proc, config)
    try:
        before = {i: layer_pages(client, pools, i, [8, 9, 10]) for i in (2, 3)}
        handle = client.load(tokens, {"full": [8, 9, 10], "conv": [8]})
        assert handle is not None
        load = handle.load_id
        handle.wait_layer(0)
        handle.wait_layer(1)
        with pytest.raises(
            LayerLoadError, match=rf"^load {load}: layer 2 did not land: {FAULT}$"
        ) as info:
            handle.wait_layer(2)
        assert (info.value.load_id, info.value.layer_id) == (load, 2)
        with pytest.raises(
            LayerLoadError,
            match=rf"^load {load}: layer 15 did not land: layer 2 failed first \({FAULT}\)$",
        ):
            handle.wait_layer(15)
        assert handle.done() == "failed"
        # after the end (the slot is released) the handle still answers the same way
        handle.wait_layer(1)
        with pytest.raises(LayerLoadError, match=rf"^load {load}: layer 3 did not land: "):
            handle.wait_layer(3)
        for i in (0, 1):  # landed: the stored bytes
            assert layer_pages(client, pools, i, [8, 9, 10]) == layer_pages(
                client, pools, i, [0, 1, 2]
            )
        for i in (2, 3):  # never written
            assert layer_pages(client, pools, i, [8, 9, 10]) == before[i]
        settled(proc)
        stats = proc.get_json("/v1/stats")
        assert stats["namespaces"][0]["groups"]["full"]["l2_pages"] == 3  # still cached
    finally:
        client.close()


def test_a_cancelled_load_raises_in_wait_layer_over_the_sidecar(
    slow: tuple[SidecarProcess, Path],
) -> None:
    proc, config = slow
    client, _, tokens = stored_prompt(proc, config)
    try:
        handle = client.load(tokens, {"full": [8, 9, 10], "conv": [8]})
        assert handle is not None
        handle.wait_layer(0)
        handle.cancel()  # the engine gives up on it; the sidecar cancels the walk
        with pytest.raises(
            LayerLoadError, match=rf"^load {handle.load_id}: layer 15 did not land: cancelled$"
        ):
            handle.wait_layer(15, timeout_s=10)
        settled(proc)
    finally:
        client.close()


def test_the_row_carries_the_stop_while_the_load_is_still_running(tmp_path: Path) -> None:
    """The client half on its own, against a counter file written the way the sidecar's
    `on_layer` and `finished` write it: the stop is seen before the load's end."""
    layer_map = load_deployment(write_config(tmp_path)).layer_map()
    counters = CounterFile.create(2)
    released: list[int] = []

    def handle_for(load_id: int, slot: int) -> LoadHandle:
        counters.start(slot, load_id, num_layers=16)
        reply = {"load_id": load_id, "slot": slot, "tokens": 32, "failed": {}}
        return LoadHandle(released.append, layer_map, counters, 1, lambda: 1, reply, [])

    handle = handle_for(7, 1)
    counters.array[1][1] = 5  # layers 0..4 landed
    long_reason = "RuntimeError: " + "é" * 400  # longer than the row's text: cut, still UTF-8
    counters.stop(1, LayerFailure(5, StopKind.FAILED_LAYER, long_reason))
    assert handle.state() == "running"  # the op has not ended: done() would still wait
    handle.wait_layer(4)
    with pytest.raises(LayerLoadError, match=r"^load 7: layer 5 did not land: RuntimeError: é+$"):
        handle.wait_layer(5)
    with pytest.raises(LayerLoadError, match=r"^load 7: layer 9 did not land: layer 5 failed "):
        handle.wait_layer(9)
    counters.end(1, LoadState.FAILED, "RuntimeError: ...")  # the stop it had is kept
    assert handle.done() == "failed"
    assert released == [7]
    kept = long_reason.encode()[:256].decode(errors="ignore")
    assert counters.failure(1) == LayerFailure(5, StopKind.FAILED_LAYER, kept)
    handle_for(8, 1)  # the slot serves another load now
    with pytest.raises(LayerLoadError, match=r"^load 7: layer 5 did not land: RuntimeError: "):
        handle.wait_layer(5)
    handle.wait_layer(2)

    # a load that ended cancelled before its walk ran: `end` writes the stop at layer 0
    queued = handle_for(9, 0)
    counters.end(0, LoadState.CANCELLED, "cancelled before it started")
    with pytest.raises(
        LayerLoadError, match=r"^load 9: layer 0 did not land: cancelled before it started$"
    ):
        queued.wait_layer(0)
    assert queued.done() == "cancelled"
