"""A session's end is a fact the engine can see, against a real sidecar (`serve()` on the fake
copy backend, copies slowed) and the real client: a store (or load) in flight when its
session's connection drops, and the same process registering its memory again — the new
registration succeeds only once the old session ended with every copy of it; the replies
name their session (the epoch), and `Client.confirmed` says when an unanswered op is over.

Defect 2 of issue 32: the sidecar let the same process register the same memory while its old
session still ran a store, and vLLM reused the blocks under it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from hicache.channel.counters import LoadState
from hicache.channel.shm import SharedPools
from hicache.client import Client, ClientError, NoReplyError, connect
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from tests.service.epochs import PAGE, deployment, fill, slowed_sidecar, wrong_pages

LAYER_DELAY_S = 0.25  # each copied layer: a store or load of LAYERS layers takes 1 s at least
TIMEOUT_S = 0.3  # the client's: well under a slowed copy, far over an op's milliseconds


def registered_again(client: Client) -> dict[str, Any]:
    """Call until the reconnect's registration went through: each try waits for the old
    session (or is refused `busy`, or outlasts the client's timeout); the deadline bounds a
    hang only."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return client.stats()
        except NoReplyError:
            pass
        except ClientError as exc:
            if exc.code != "busy":
                raise
        if time.monotonic() > deadline:
            raise AssertionError("never registered again")


def live_sessions(sidecar: SidecarProcess) -> set[int]:
    return {s["id"] for s in sidecar.get_json("/v1/stats")["sessions"]}


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return deployment(tmp_path, heartbeat_timeout_s=30)


def client_of(sidecar: SidecarProcess, config: Path, timeout_s: float) -> Client:
    """A client whose calls time out after `timeout_s`; connecting (hello) is retried, as a
    short timeout may pass on a busy machine."""
    deadline = time.monotonic() + 60  # bounds a hang only
    while True:
        try:
            return connect(
                sidecar.socket,
                load_deployment(config).layer_map(),
                page_size_tokens=PAGE,
                heartbeat=False,
                timeout_s=timeout_s,
            )
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


def registered(client: Client, pools: SharedPools) -> None:
    """`register_pools`, tried again while a short timeout passes first."""
    deadline = time.monotonic() + 60  # bounds a hang only
    while True:
        try:
            client.register_pools(pools)
            return
        except NoReplyError:
            if time.monotonic() > deadline:
                raise


def test_a_store_in_flight_keeps_its_memory_from_the_same_processs_next_session(
    config: Path,
) -> None:
    tokens = list(range(3 * PAGE))
    with (
        slowed_sidecar(config, backup_layer_delay_s=LAYER_DELAY_S) as sidecar,
        client_of(sidecar, config, TIMEOUT_S) as client,
    ):
        pools = client.create_pools(8)
        registered(client, pools)
        first = client.epoch
        assert first is not None
        assert first.session == client.session["session"]
        fill(pools.device_pools(), tokens, [0, 1, 2])
        with pytest.raises(NoReplyError) as info:
            client.store(tokens, {"full": [0, 1, 2]})
        assert info.value.epoch == first
        assert not client.confirmed(first)  # nothing said yet: the store may be running
        registered_again(client)
        # the registration went through: the old session had ended, its store's backup
        # with it, before the sidecar handed its memory to the new one
        assert client.confirmed(first)
        assert client.epoch is not None
        assert client.epoch.session > first.session
        assert first.session not in live_sessions(sidecar)
        fill(
            pools.device_pools(), list(range(1000, 1000 + 3 * PAGE)), [0, 1, 2]
        )  # the engine reuses them
        # what the store filed is the first prompt's bytes, loaded back into other pages
        client.timeout_s = 30.0  # the loads' walks are not slowed: no more timeouts wanted
        handle = client.load(tokens, {"full": [4, 5, 6]})
        assert handle is not None
        assert handle.tokens == len(tokens)
        assert handle.done() == "done"
        assert handle.epoch == client.epoch
        assert wrong_pages(pools.device_pools(), tokens, [4, 5, 6]) == 0


def test_a_load_in_flight_keeps_its_memory_from_the_same_processs_next_session(
    config: Path,
) -> None:
    tokens = list(range(2 * PAGE))
    with (
        slowed_sidecar(config, load_layer_delay_s=LAYER_DELAY_S) as sidecar,
        client_of(sidecar, config, 30.0) as client,
    ):
        pools = client.create_pools(8)
        client.register_pools(pools)
        fill(pools.device_pools(), tokens, [0, 1])
        reply = client.store(tokens, {"full": [0, 1]})
        assert reply["session"] == client.session["session"]
        handle = client.load(tokens, {"full": [2, 3]})
        assert handle is not None
        assert handle.epoch == client.epoch
        row = handle._row  # the old session's counter row: its state is the sidecar's word
        assert LoadState(int(row[2])) == LoadState.RUNNING
        client._drop_socket()  # what a timed-out call does: the connection is gone
        registered_again(client)
        assert client.confirmed(handle.epoch)
        assert LoadState(int(row[2])) in (LoadState.CANCELLED, LoadState.DONE), row
        assert handle.epoch.session not in live_sessions(sidecar)


def test_a_second_live_session_of_the_same_memory_is_refused_busy(config: Path) -> None:
    """Two clients of one process, one pool: the second registration is refused while the
    first session is open, naming it; once that client closed, a new client (as a
    reconnect: hello, then the registration) registers it."""
    with slowed_sidecar(config) as sidecar, client_of(sidecar, config, 30.0) as first:
        pools = first.create_pools(4)
        first.register_pools(pools)
        with client_of(sidecar, config, 30.0) as second:
            with pytest.raises(ClientError) as info:
                second.register_pools(pools)
            second.pools = None  # the pool is not its to close
        assert info.value.code == "busy"
        assert info.value.message.startswith(
            "register_pools: this memory is still registered by session "
            f"{first.session['session']} (engine pid "
        )
        assert "its connection is still open: close that client first" in info.value.message
        first.pools = None  # its connection goes, the pool stays (the third's now)
        first.close()
        with client_of(sidecar, config, 30.0) as third:
            third.register_pools(pools)
            assert first.epoch is not None
            assert third.confirmed(first.epoch)
