"""The engine client against real `hicache serve` processes: the async flavour, reconnect
across a sidecar restart, TCP with a token, and a hung engine dropped by the heartbeat
watchdog."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hicache.channel.counters import CounterFile, LoadState
from hicache.client import ClientError, LoadLostError, connect, connect_async
from hicache.client.handle import LoadHandle
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from tests.service.conftest import engine, read_event, write_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pages(first: int, n: int) -> dict[str, list[int]]:
    return {"full": list(range(first, first + n)), "conv": [first]}


def store_args(first: int, n: int) -> tuple[dict[str, list[int]], dict[str, dict[int, int]]]:
    """A store's arguments for `n` full pages: the conv group's snapshot after them."""
    return {"full": list(range(first, first + n))}, {"conv": {n * 16: first}}


@pytest.mark.asyncio
async def test_async_client_round_trip(sidecar: SidecarProcess, deploy: Path) -> None:
    loaded = load_deployment(deploy)
    client = await connect_async(sidecar.socket, loaded.layer_map(), page_size_tokens=16)
    try:
        pools = client.create_pools(16)
        await client.register_pools(pools)
        device = pools.device_pools()
        for layer in device["full"].tensors:
            for t in layer.values():
                t[: 3 * 16].normal_()
        tokens = list(range(48))
        assert (await client.lookup(tokens)).tokens_total == 0
        stored = await client.store(tokens, *store_args(0, 3))
        assert stored["pages_stored"] == 4  # 3 full-attention pages + 1 conv snapshot
        assert (await client.lookup(tokens)).tokens_l2 == 48
        handle = await client.load(tokens, pages(8, 3))
        assert handle is not None
        for layer_id in client.layer_map.stage_layer_ids:
            handle.wait_layer(layer_id)
        assert await handle.finished() == "done"
        for layer in device["full"].tensors:
            for t in layer.values():
                assert torch.equal(t[8 * 16 : 11 * 16], t[:48])
        stats = await client.stats()
        assert stats["load"]["ops"] == 1
        deadline = time.monotonic() + 60  # bounds a hang only (#26: a busy machine)
        while time.monotonic() < deadline:  # the release the handle sent is on the loop
            if not sidecar.get_json("/v1/stats")["sessions"][0]["loads_unreleased"]:
                break
            await asyncio.sleep(0.01)
        assert sidecar.get_json("/v1/stats")["sessions"][0]["loads_unreleased"] == 0
    finally:
        await client.close()


def test_client_reconnects_after_sidecar_restart(deploy: Path) -> None:
    loaded = load_deployment(deploy)
    first = SidecarProcess(deploy).start()
    client = connect(first.socket, loaded.layer_map(), page_size_tokens=16, heartbeat=False)
    try:
        pools = client.create_pools(16)
        client.register_pools(pools)
        tokens = list(range(64))
        for layer in pools.device_pools()["full"].tensors:
            for t in layer.values():
                t[:64].normal_()
        client.store(tokens, *store_args(0, 4))  # write-through: persisted to the file L3
        handle = client.load(tokens, pages(8, 4))
        assert handle is not None
        assert handle.done() == "done"
        pending = client.load(tokens, pages(8, 4))
        assert pending is not None
        assert first.stop() == 0
        with SidecarProcess(deploy) as second:
            # the next call reconnects, says hello and re-registers the same shared pool
            hit = client.lookup(tokens)
            assert hit.tokens_total == 64  # found in L3 by the new process (after discovery)
            again = client.load(tokens, pages(8, 4))
            assert again is not None
            assert again.done() == "done"
            assert pending.done() == "done"  # the drain let it finish before the restart
            assert second.get_json("/v1/stats")["sessions"][0]["pid"] == os.getpid()
    finally:
        client.close()


def test_tcp_needs_the_token(tmp_path: Path) -> None:
    port = free_port()
    config = write_config(tmp_path, tcp_host="127.0.0.1", tcp_port=port, token="tok")
    loaded = load_deployment(config)
    with SidecarProcess(config):
        with pytest.raises(ClientError) as info:
            connect(f"tcp://127.0.0.1:{port}", loaded.layer_map(), page_size_tokens=16)
        assert info.value.code == "refused"
        assert info.value.message == "hello.token: missing or wrong (service.token is set)"
        client = connect(
            f"tcp://127.0.0.1:{port}",
            loaded.layer_map(),
            page_size_tokens=16,
            token="tok",
            heartbeat=False,
        )
        pools = client.create_pools(8)
        with pytest.raises(ClientError) as info:  # no kernel-named peer: no shared memory
            client.register_pools(pools)
        assert info.value.code == "refused"
        assert info.value.message == (
            "register_pools: this session came over TCP; shared memory is registered only over "
            f"the Unix socket ({loaded.deployment.service.socket_path}), whose peer the kernel "
            "names, so that no session can register another process's memory"
        )
        client.close()
        # what TCP carries: a scheduler's lookups beside an engine attached on the socket
        with (
            connect(
                loaded.deployment.service.socket_path,
                loaded.layer_map(),
                page_size_tokens=16,
                token="tok",
                heartbeat=False,
                engine="e1",
            ) as owner,
            connect(
                f"tcp://127.0.0.1:{port}",
                loaded.layer_map(),
                page_size_tokens=16,
                token="tok",
                heartbeat=False,
                engine="e1",
                role="lookup",
            ) as scheduler,
        ):
            owner.register_pools(owner.create_pools(8))
            assert scheduler.lookup(list(range(32))).tokens_total == 0


def test_hung_engine_is_dropped_after_the_heartbeat_timeout(
    sidecar: SidecarProcess, deploy: Path
) -> None:
    hung = engine("load-loop", deploy)
    try:
        assert read_event(hung)["event"] == "registered"
        assert read_event(hung)["event"] == "looping"
        os.kill(hung.pid, signal.SIGSTOP)  # alive, socket open, silent
        stopped = time.monotonic()
        while sidecar.get_json("/v1/stats")["sessions"]:
            # dropped at all (60 s past the timeout bounds a hang, not how fast: a busy machine)
            assert time.monotonic() - stopped < 2.0 + 60.0, "not dropped after the timeout"
            time.sleep(0.1)
        waited = time.monotonic() - stopped
        assert waited >= 1.5  # heartbeat_timeout_s is 2: not before it (minus poll slack)
        # the refused ops left no pin; the writes to L3 behind the acked store pin their pages
        # while L3 reads them, and let go when written
        deadline = time.monotonic() + 60  # bounds a hang only (#26: a busy machine)
        while True:
            stats = sidecar.get_json("/v1/stats")
            pins = [g["pinned_pages"] for g in stats["namespaces"][0]["groups"].values()]
            if not any(pins) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert not any(pins), pins
        assert "engine missed heartbeats" in deploy.with_suffix(".serve.log").read_text()
    finally:
        os.kill(hung.pid, signal.SIGKILL)
        hung.wait()


def test_a_load_in_flight_when_the_connection_resets_is_lost(tmp_path: Path) -> None:
    loaded = load_deployment(write_config(tmp_path))
    counters = CounterFile.create(4)
    counters.start(2, load_id=7, num_layers=16)
    generation = [1]
    reply = {"load_id": 7, "slot": 2, "tokens": 32, "failed": {}}
    handle = LoadHandle(
        lambda load_id: None, loaded.layer_map(), counters, 1, lambda: generation[0], reply, []
    )
    assert handle.state() == "running"
    counters.array[2][1] = 1  # layer 0 landed
    handle.wait_layer(0)
    generation[0] = 2  # the client reconnected: this load's session is gone
    with pytest.raises(LoadLostError, match="load 7: the sidecar connection was reset"):
        handle.wait_layer(1)
    counters.array[2][2] = LoadState.DONE  # had it ended before the reset, it would say so
    assert handle.state() == "done"


def test_tenants_never_see_each_others_pages(sidecar: SidecarProcess, deploy: Path) -> None:
    loaded = load_deployment(deploy)
    tokens = list(range(64))
    clients = {
        tenant: connect(
            sidecar.socket, loaded.layer_map(), page_size_tokens=16, tenant=tenant, heartbeat=False
        )
        for tenant in ("acme", "globex")
    }
    try:
        for client in clients.values():
            client.register_pools(client.create_pools(8))
        assert clients["acme"].store(tokens, *store_args(0, 4))["pages_stored"] == 5
        assert clients["acme"].lookup(tokens).tokens_total == 64
        assert clients["globex"].lookup(tokens).tokens_total == 0  # same tokens, other tenant
        namespaces = {ns["namespace"] for ns in sidecar.get_json("/v1/stats")["namespaces"]}
        assert namespaces == {"tp_rank=0 tenant='acme'", "tp_rank=0 tenant='globex'"}
    finally:
        for client in clients.values():
            client.close()


def test_too_few_device_pages_is_a_clear_error(sidecar: SidecarProcess, deploy: Path) -> None:
    loaded = load_deployment(deploy)
    client = connect(sidecar.socket, loaded.layer_map(), page_size_tokens=16, heartbeat=False)
    try:
        client.register_pools(client.create_pools(8))
        tokens = list(range(64))  # 4 full pages
        with pytest.raises(ClientError) as info:
            client.store(tokens, {"full": [0, 1]}, {"conv": {64: 0}})
        assert info.value.code == "bad_request"
        assert info.value.message == (
            "store: device_pages.full: 2 pages given; the prompt's 4 full pages need 4 entries "
            "(None for a page the engine no longer holds)"
        )
        with pytest.raises(ClientError) as info:
            client.load(tokens, {"full": [0, 1, 2, 3], "conv": []})
        assert info.value.message == (
            "load: device_pages.conv: 0 pages given; the prompt's 4 full pages need 1 snapshot page"
        )
        assert client.store(tokens, *store_args(0, 4))["pages_stored"] == 5  # nothing was pinned
        # the refused ops left no pin; the writes to L3 behind the acked store pin their pages
        # while L3 reads them, and let go when written
        deadline = time.monotonic() + 60  # bounds a hang only (#26: a busy machine)
        while True:
            stats = sidecar.get_json("/v1/stats")
            pins = [g["pinned_pages"] for g in stats["namespaces"][0]["groups"].values()]
            if not any(pins) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert not any(pins), pins
    finally:
        client.close()


def serve_once(config: Path) -> subprocess.CompletedProcess[str]:
    """`hicache serve` expected to fail at start: its exit code and output."""
    return subprocess.run(
        [sys.executable, "-m", "hicache", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_that_cannot_listen_says_where_and_why(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = serve_once(write_config(tmp_path, http_port=port))
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"hicache: error: service.http_host/http_port: cannot listen on 127.0.0.1:{port}: "
    )
    assert "address already in use" in line.lower()
    result = serve_once(write_config(tmp_path, socket_path="/proc/hicache-nope/e.sock"))
    assert result.returncode == 2, result.stderr
    assert "hicache: error: service.socket_path: cannot listen on '/proc/hicache-nope/e.sock'" in (
        result.stderr
    )


def test_lookup_sessions_share_an_engines_namespace(sidecar: SidecarProcess, deploy: Path) -> None:
    """vLLM's scheduler process asks lookups beside the worker that owns the pools: a 'lookup'
    session joins the engine's namespace, sees its pages, and may not store, load or register."""
    loaded = load_deployment(deploy)
    tokens = list(range(64))
    kwargs = {"page_size_tokens": 16, "heartbeat": False, "engine": "vllm:e1"}
    scheduler = connect(sidecar.socket, loaded.layer_map(), role="lookup", **kwargs)
    stranger = connect(
        sidecar.socket,
        loaded.layer_map(),
        role="lookup",
        page_size_tokens=16,
        heartbeat=False,
        engine="vllm:e2",
    )
    try:
        # before any engine registered pools nothing is cached: a zero hit, not an error
        assert scheduler.lookup(tokens).tokens_total == 0
        with connect(sidecar.socket, loaded.layer_map(), **kwargs) as worker:
            worker.register_pools(worker.create_pools(8))
            worker.store(tokens, *store_args(0, 4))
            assert scheduler.lookup(tokens).tokens_total == 64
            assert scheduler.prefetch(tokens) == 0  # all in L2 already
            # another engine's scheduler: this engine's worker holds the namespace, not its
            # own, so it is promised nothing it could not load
            assert stranger.lookup(tokens).tokens_total == 0
            with pytest.raises(
                ClientError,
                match=r"refused: store: this session said hello with role 'lookup'; it may only lookup, prefetch and ask stats",
            ):
                scheduler.store(tokens, *store_args(0, 4))
            with pytest.raises(
                ClientError,
                match=r"refused: register_pools: this session said hello with role 'lookup'; only an 'engine' session registers pools",
            ):
                scheduler.register_pools(scheduler.create_pools(8))
            # another engine's worker attaches to the namespace beside this one: then that
            # engine's scheduler is promised the shared hits, which its worker can load
            other_kwargs = {**kwargs, "engine": "vllm:e2"}
            with connect(sidecar.socket, loaded.layer_map(), **other_kwargs) as other:
                other.register_pools(other.create_pools(8))
                assert stranger.lookup(tokens).tokens_total == 64
            with pytest.raises(
                ClientError, match=r"refused: load: this session said hello with role 'lookup'"
            ):
                scheduler.load(tokens, pages(0, 4))
        # the worker is gone (its session ends a moment after close): no hits promised until
        # a worker of this engine is back
        deadline = time.monotonic() + 60  # bounds a hang only (#26: a busy machine)
        while scheduler.lookup(tokens).tokens_total and time.monotonic() < deadline:
            time.sleep(0.02)
        assert scheduler.lookup(tokens).tokens_total == 0
    finally:
        scheduler.close()
        stranger.close()
