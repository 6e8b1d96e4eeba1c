"""The sidecar's KV-event replay socket (`service.kv_events.replay_endpoint`), against a real
`hicache serve`: a subscriber that stopped reading while an engine stored finds gaps in
`seq` (at least the start's `AllBlocksCleared`, sent before it subscribed; and what ZMQ
dropped past the high-water marks), asks the replay socket for everything from seq 0 (its
first missing one), gets what it holds byte for byte and the rest, and ends with exactly
the view a live router built up to the same batch; a malformed request is
counted and ignored. The replay is docs/engines.md's `replay`, run as written. The publisher's bounded buffer and the config's refusals are
`test_kv_events_unit.py`'s."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hicache.client.process import SidecarProcess
from tests.conftest import REPO
from tests.service.test_kv_events import (
    DEADLINE_S,
    Router,
    blocks,
    engine,
    prompts,
    serve,
    store,
    wait_until,
    write_deploy,
)

zmq = pytest.importorskip("zmq", reason="pyzmq (the events extra) is not installed")
msgspec = pytest.importorskip("msgspec", reason="msgspec (the events extra) is not installed")

__all__ = ["serve"]  # the fixture, shared with test_kv_events.py


class View(Router):
    """A router's view built from batches in hand (the stalled socket's and the replay's)."""

    def __init__(self) -> None:  # no socket: `apply` only
        self.held = {"CPU": {}, "STORAGE": {}}
        self.stored = {"CPU": 0, "STORAGE": 0}
        self.removed = {"CPU": 0, "STORAGE": 0}
        self.seqs = []


def docs_replay() -> Callable[..., dict[int, bytes]]:
    """docs/engines.md's `replay` (`replay.py`), its code as written."""
    text = (REPO / "docs" / "engines.md").read_text()
    start = text.index("`replay.py`, its `replay` function")
    code = text[text.index("```python\n", start) + len("```python\n") :]
    namespace: dict[str, Any] = {"__name__": "replay"}
    exec(compile(code[: code.index("```")], "docs/engines.md (replay.py)", "exec"), namespace)
    replay: Callable[..., dict[int, bytes]] = namespace["replay"]
    return replay


def test_a_stalled_subscriber_fills_its_gaps_through_replay_into_the_live_view(
    tmp_path: Path, serve: Callable[[Path], SidecarProcess]
) -> None:
    deploy = write_deploy(
        tmp_path, {"kind": "none"}, hwm=16, replay_endpoint="tcp://127.0.0.1:0", buffer_steps=4096
    )
    sidecar = serve(deploy)
    section = sidecar.get_json("/v1/stats")["kv_events"]
    context = zmq.Context()
    stalled = context.socket(zmq.SUB)  # subscribes, then reads nothing while the engine stores
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(section["endpoint"])
    replay_endpoint = section["replay_endpoint"]
    replay = docs_replay()
    router = Router(sidecar, subscribers=2)  # live, once the stalled one is counted too
    client = engine(sidecar, deploy)
    try:
        for i, prompt in enumerate(prompts(7, 64, 1)):
            assert store(client, prompt)["pages_stored"] == 1, f"store {i}"
            # the live router keeps up (a high-water mark of 16 drops for it too, if its
            # ZMQ thread falls that far behind on a busy machine): it reads each store's block
            block = next(iter(blocks(prompt)))
            router.until(lambda r, b=block: b in r.held["CPU"], f"store {i}'s block")
        router.until(lambda r: r.removed["CPU"] == 64 - 16, "the live router's evictions")
        received: dict[int, bytes] = {}
        while stalled.poll(0):
            _topic, seq, payload = stalled.recv_multipart()
            received[int.from_bytes(seq, "big")] = payload
        replayed = replay(
            context, replay_endpoint, 0, int(DEADLINE_S * 1000)
        )  # every batch the sidecar sent so far (buffer_steps)
        last = max(replayed)
        assert sorted(replayed) == list(range(last + 1))
        missing = sorted(set(replayed) - set(received))
        assert missing, "no gap"  # seq 0 at least: sent before it subscribed
        assert missing[0] == 0
        # the live router, read up to the same batch (it takes one at a time)
        router.until(lambda r: r.seqs[-1] >= last, f"the live router at seq {last}")
        assert router.seqs[-1] == last
        live = router.seqs
        assert live == list(range(live[0], last + 1))  # the live one lost nothing
        for seq, payload in received.items():
            assert replayed[seq] == payload, f"seq {seq} replayed differently"
        view = View()
        for seq in range(last + 1):
            for event in msgspec.msgpack.decode(received.get(seq, replayed[seq]))[1]:
                view.apply(event)
        assert view.held == router.held  # the stalled subscriber's view is whole again
        assert (view.stored, view.removed) == ({"CPU": 64, "STORAGE": 0}, router.removed)
        # a malformed request (no 8-byte seq) is counted and ignored; the next one answered
        malformed = context.socket(zmq.DEALER)
        malformed.connect(replay_endpoint)
        malformed.send_multipart([b"", b"seq"])
        wait_until(
            lambda: sidecar.get_json("/v1/stats")["kv_events"]["replays_malformed"] == 1,
            "the malformed request counted",
        )
        malformed.close(linger=0)
        assert sorted(replay(context, replay_endpoint, last)) == [last]
        stats = sidecar.get_json("/v1/stats")["kv_events"]
        assert (stats["replays"], stats["replays_malformed"]) == (2, 1), stats
        print(f"stalled subscriber: {len(received)} of {last + 1} batches, {len(missing)} replayed")
    finally:
        client.close()
        router.close()
        stalled.close(linger=0)
        context.term()
