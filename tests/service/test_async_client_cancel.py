"""An `AsyncClient` call cancelled in the loop step its reply arrives ends cancelled. On
Python 3.11 `asyncio.wait_for` returned the reply there and dropped the cancel: the
heartbeat task that `asyncio.run` cancels on the way out kept beating, and a process whose
engine raised never exited (tests/test_process_exit.py, 2 runs in 15 on a busy machine). The
reply is fed to the client's reader in the same step as the cancel, so the ordering is forced,
not hoped for; a stand-in sidecar answers hello and holds every other request.

A call cancelled while its request is out drops the connection, as one with no reply in time
does: its reply (or half of it) is never read as the next request's, the sidecar ends the
session and its ops (a load's slot and copies with it), and `cancelled_in` names that session
for `confirmed`. `close()` during a call: the call fails and nothing reconnects; `close()`
cancelled while it waits for the heartbeat task still closes the connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from hicache.channel import protocol as p
from hicache.client import ClientError, connect_async
from hicache.model import LayerMap, load_layout
from tests.conftest import shared_model

pytestmark = pytest.mark.asyncio


class HoldingSidecar:
    """Answers hello; queues the requests of `hold` ops unanswered in `held` (with the
    connection's writer, for a late reply); answers the rest with `{"op": op}`."""

    def __init__(self, hold: frozenset[str] = frozenset({"heartbeat", "load", "lookup"})):
        self.hold = hold
        self.held: asyncio.Queue[tuple[dict[str, Any], asyncio.StreamWriter]] = asyncio.Queue()
        self.writers: list[asyncio.StreamWriter] = []
        self.hellos = 0
        self.ended = asyncio.Event()  # a connection was closed by the client

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        try:
            while True:
                (size,) = p.HEADER.unpack(await reader.readexactly(p.HEADER.size))
                request = p.unpack(await reader.readexactly(size))
                if request["op"] == "hello":
                    self.hellos += 1
                    writer.write(p.ok(request["id"], {"heartbeat_timeout_s": 30.0}))
                elif request["op"] in self.hold:
                    await self.held.put((request, writer))
                else:
                    writer.write(p.ok(request["id"], {"op": request["op"]}))
        except (asyncio.IncompleteReadError, ConnectionError):
            self.ended.set()


@pytest_asyncio.fixture
async def sidecar(tmp_path: Path) -> AsyncIterator[tuple[HoldingSidecar, Path]]:
    stand_in = HoldingSidecar()
    path = tmp_path / "s.sock"
    server = await asyncio.start_unix_server(stand_in.serve, str(path))
    try:
        yield stand_in, path
    finally:
        for writer in stand_in.writers:
            writer.close()
        server.close()
        await server.wait_closed()


def layer_map() -> LayerMap:
    return LayerMap(load_layout(shared_model("qwen2_7b.json")))


async def test_a_cancel_landing_with_the_reply_ends_the_call(
    sidecar: tuple[HoldingSidecar, Path],
) -> None:
    stand_in, path = sidecar
    client = await connect_async(path, layer_map(), page_size_tokens=2, heartbeat=False)
    task = asyncio.create_task(client.call("heartbeat", {}))
    request, _ = await asyncio.wait_for(stand_in.held.get(), 30)  # awaits its reply
    assert client._reader is not None
    client._reader.feed_data(p.ok(request["id"], {}))  # the reply and the cancel: one step
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    await client.close()


async def test_the_heartbeat_task_ends_when_cancelled_mid_call(
    sidecar: tuple[HoldingSidecar, Path],
) -> None:
    """What `asyncio.run` does to the heartbeat task on the way out, as a heartbeat's reply
    lands."""
    stand_in, path = sidecar
    client = await connect_async(path, layer_map(), page_size_tokens=2, heartbeat=False)
    client.session["heartbeat_timeout_s"] = 0.15  # beats every 0.05 s
    beat = asyncio.create_task(client._heartbeats())
    request, _ = await asyncio.wait_for(stand_in.held.get(), 30)
    assert client._reader is not None
    client._reader.feed_data(p.ok(request["id"], {}))
    beat.cancel()
    await asyncio.wait_for(asyncio.gather(beat, return_exceptions=True), 5)
    assert beat.cancelled()
    await client.close()


async def test_a_reply_that_comes_after_its_call_was_cancelled_is_never_read(
    sidecar: tuple[HoldingSidecar, Path],
) -> None:
    """Without the drop, the next call read the cancelled call's reply (`unexpected reply`),
    and every later call the one before it."""
    stand_in, path = sidecar
    client = await connect_async(path, layer_map(), page_size_tokens=2, heartbeat=False)
    sent_in = client.now()
    task = asyncio.create_task(client.lookup([1, 2, 3, 4]))
    request, writer = await asyncio.wait_for(stand_in.held.get(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.cancelled_in == sent_in
    writer.write(p.ok(request["id"], {"late": True}))  # on the old connection, if still open
    for _ in range(3):
        assert await client.call("stats") == {"op": "stats"}
    assert stand_in.hellos == 2  # the cancelled call's session ended; a new one took over
    await asyncio.wait_for(stand_in.ended.wait(), 30)
    await client.close()


async def test_a_load_cancelled_as_its_reply_lands_ends_the_session(
    sidecar: tuple[HoldingSidecar, Path],
) -> None:
    """The reply named a load the sidecar started; the caller got no handle to release it.
    The connection is dropped, so the sidecar ends the session, the load and its slot."""
    stand_in, path = sidecar
    client = await connect_async(path, layer_map(), page_size_tokens=2, heartbeat=False)
    groups = [group.name for group in client.layer_map.groups]
    task = asyncio.create_task(client.load([1, 2, 3, 4], {g: [0, 1] for g in groups}))
    request, _ = await asyncio.wait_for(stand_in.held.get(), 30)
    assert client._reader is not None
    client._reader.feed_data(p.ok(request["id"], {"load_id": 7, "session": 1}))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(stand_in.ended.wait(), 30)
    assert client.cancelled_in is not None
    assert not client.confirmed(client.cancelled_in)  # nothing said the session ended yet
    await client.close()


async def test_close_during_a_call_fails_it_and_nothing_reconnects(
    sidecar: tuple[HoldingSidecar, Path],
) -> None:
    stand_in, path = sidecar
    client = await connect_async(path, layer_map(), page_size_tokens=2, heartbeat=False)
    task = asyncio.create_task(client.lookup([1, 2, 3, 4]))
    await asyncio.wait_for(stand_in.held.get(), 30)
    await client.close()
    with pytest.raises(ClientError, match="closed"):
        await task
    assert stand_in.hellos == 1
    assert client._writer is None
    with pytest.raises(ClientError, match="closed"):
        await client.call("stats")


async def test_close_cancelled_while_it_waits_for_the_heartbeat_still_closes(
    sidecar: tuple[HoldingSidecar, Path],
) -> None:
    stand_in, path = sidecar
    client = await connect_async(path, layer_map(), page_size_tokens=2)
    closing = asyncio.create_task(client.close())
    await asyncio.sleep(0)  # close() cancelled the heartbeat task and waits for it
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert client._writer is None
    await asyncio.wait_for(stand_in.ended.wait(), 30)
