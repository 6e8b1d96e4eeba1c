"""An `AsyncClient` call cancelled in the loop step its reply arrives ends cancelled. On
Python 3.11 `asyncio.wait_for` returned the reply there and dropped the cancel: the
heartbeat task that `asyncio.run` cancels on the way out kept beating, and a process whose
engine raised never exited (tests/test_process_exit.py, 2 runs in 15 on a busy machine). The
reply is fed to the client's reader in the same step as the cancel, so the ordering is forced,
not hoped for; a stand-in sidecar answers hello and holds every other request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from hicache.channel import protocol as p
from hicache.client import connect_async
from hicache.model import LayerMap, load_layout
from tests.conftest import shared_model

pytestmark = pytest.mark.asyncio


class HoldingSidecar:
    """Answers hello; queues every other request unanswered in `held`."""

    def __init__(self) -> None:
        self.held: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.writers: list[asyncio.StreamWriter] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        try:
            while True:
                (size,) = p.HEADER.unpack(await reader.readexactly(p.HEADER.size))
                request = p.unpack(await reader.readexactly(size))
                if request["op"] == "hello":
                    writer.write(p.ok(request["id"], {"heartbeat_timeout_s": 30.0}))
                else:
                    await self.held.put(request)
        except asyncio.IncompleteReadError:
            return


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
    request = await asyncio.wait_for(stand_in.held.get(), 30)  # the call awaits its reply
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
    request = await asyncio.wait_for(stand_in.held.get(), 30)
    assert client._reader is not None
    client._reader.feed_data(p.ok(request["id"], {}))
    beat.cancel()
    await asyncio.wait_for(asyncio.gather(beat, return_exceptions=True), 5)
    assert beat.cancelled()
    await client.close()
