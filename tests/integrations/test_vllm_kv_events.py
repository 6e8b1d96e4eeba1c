"""KV events from the connector through vLLM's own event channel, with real vLLM (the CPU
build): an engine with `kv_events_config` publishing on loopback ZMQ (and its replay socket)
and the hicache connector (`kv_producer`, each store answered once L3 holds its pages). A
plain ZMQ SUB — filling what it missed through vLLM's replay socket, as a router does —
receives for one prompt vLLM's own `GPU` events and hicache's `CPU` and `STORAGE` events for
the same blocks, with equal hashes (vLLM's `Request.block_hashes`, `vllm/kv_events.py`).
The sidecar's own publisher (`service.kv_events`, its defaults) names the same blocks with
the same hashes as vLLM publishes them by default (64-bit integers: vLLM 0.32's
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`), so a router mixing both channels matches them.

vLLM is required here as in test_vllm.py; without it, outside CI, the module skips.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from hicache.client.process import SidecarProcess
from tests.integrations.vllm_harness import PAGE, EngineProcess, write_deployment
from tests.integrations.vllm_models import build_model

if not os.environ.get("_HICACHE_REQUIRE_VLLM"):
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (python3 dev.py setup)")
zmq = pytest.importorskip("zmq", reason="pyzmq is not installed (the events extra)")
msgspec = pytest.importorskip("msgspec", reason="msgspec is not installed (the events extra)")

KIND = "llama"
P = PAGE[KIND]
PROMPT = [random.Random(35).randrange(3, 500) for _ in range(3 * P + P // 2)]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Subscriber:
    """A router's view of one engine: SUB for the stream, DEALER for vLLM's replay."""

    endpoint: str
    replay_endpoint: str
    context: Any = field(default_factory=lambda: zmq.Context())
    batches: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.endpoint)
        self.replay = self.context.socket(zmq.DEALER)
        self.replay.connect(self.replay_endpoint)

    def _keep(self, seq: bytes, payload: bytes) -> None:
        _ts, events, *_ = msgspec.msgpack.decode(payload)
        self.batches[int.from_bytes(seq, "big")] = events

    def drain(self, wait_ms: int) -> None:
        """What the stream has (waiting at most `wait_ms` for the first frame)."""
        while self.sub.poll(wait_ms):
            _topic, seq, payload = self.sub.recv_multipart()
            self._keep(seq, payload)
            wait_ms = 0

    def fill(self, timeout_s: float) -> None:
        """Every batch vLLM still buffers from seq 0 (the stream's gaps, and what it sent
        before this subscription took effect: ZMQ's slow joiner)."""
        self.replay.send_multipart([b"", (0).to_bytes(8, "big")])
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.replay.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                raise AssertionError(f"no end marker from {self.replay_endpoint}")
            _empty, _topic, seq, payload = self.replay.recv_multipart()
            if seq == END_SEQ:
                return
            self._keep(seq, payload)

    def stored(self) -> dict[str, list[Any]]:
        """Block hashes stored per medium, in seq order (the latest clear forgets before)."""
        held: dict[str, list[Any]] = {}
        for seq in sorted(self.batches):
            for event in self.batches[seq]:  # tagged maps, as vLLM's structs encode
                if event["type"] == "AllBlocksCleared":
                    held.clear()
                elif event["type"] == "BlockStored":
                    held.setdefault(event["medium"], []).extend(event["block_hashes"])
        return held

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)
        self.context.term()


def sidecar_stored(sub: Any, want: int, timeout_s: float) -> dict[str, list[Any]]:
    """The sidecar's BlockStored hashes per medium, until each medium has `want`."""
    held: dict[str, list[Any]] = {"CPU": [], "STORAGE": []}
    deadline = time.monotonic() + timeout_s
    while min(len(v) for v in held.values()) < want:
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0, f"the sidecar's events never covered {want} blocks: {held}"
        if not sub.poll(left_ms):
            continue
        _topic, _seq, payload = sub.recv_multipart()
        for event in msgspec.msgpack.decode(payload)[1]:
            if event["type"] == "BlockStored":
                held[event["medium"]].extend(event["block_hashes"])
    return held


@pytest.fixture(scope="module")
def engine(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EngineProcess, Subscriber, SidecarProcess]]:
    work = tmp_path_factory.mktemp("vllm_kv_events")
    model = build_model(KIND, tmp_path_factory.mktemp("vllm_models"))
    deploy = write_deployment(work / "sidecar", model, KIND)
    # the sidecar publishes too, with its defaults (the service section is the file's last)
    deploy.write_text(deploy.read_text() + "  kv_events:\n    endpoint: tcp://127.0.0.1:0\n")
    sidecar = SidecarProcess(deploy).start()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    connector = {
        "config": str(work / "sidecar" / "deploy.yaml"),
        "persisted_within_s": 60,  # each store answered once L3 holds its pages
    }
    proc = EngineProcess(
        work,
        model,
        connector=connector,
        kv_role="kv_producer",
        kv_events={"endpoint": endpoint, "replay_endpoint": replay},
    )
    subscriber: Subscriber | None = None
    try:
        proc.ready()
        subscriber = Subscriber(endpoint, replay)
        yield proc, subscriber, sidecar
    finally:
        if subscriber is not None:
            subscriber.close()
        proc.close()
        sidecar.stop()


def test_one_subscriber_sees_vllms_gpu_and_hicaches_cpu_and_storage_blocks(
    engine: tuple[EngineProcess, Subscriber, SidecarProcess],
) -> None:
    proc, sub, sidecar = engine
    context = zmq.Context()
    sidecar_sub = context.socket(zmq.SUB)
    sidecar_sub.setsockopt(zmq.SUBSCRIBE, b"")
    sidecar_sub.connect(sidecar.get_json("/v1/stats")["kv_events"]["endpoint"])
    deadline = time.monotonic() + 60
    while sidecar.get_json("/v1/stats")["kv_events"]["subscriptions"] < 1:  # no slow joiner
        assert time.monotonic() < deadline, "the sidecar never saw the subscription"
        time.sleep(0.05)  # polling the sidecar's reported state; not a synchronisation
    [result] = proc.round([PROMPT], max_tokens=1)
    assert result["cached"] == 0  # nothing to load: every page computed, then stored
    full = len(PROMPT) // P
    deadline = time.monotonic() + 120
    while True:
        sub.drain(wait_ms=200)
        held = sub.stored()
        if all(len(held.get(m, ())) >= full for m in ("GPU", "CPU", "STORAGE")):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"events never covered {full} blocks per medium: {held}")
        sub.fill(timeout_s=30)  # the batches the stream missed, from vLLM's buffer
    gpu = held["GPU"]
    assert len(gpu) == len(set(gpu)) == full, held  # the prompt's blocks in vLLM's cache
    # hicache's tiers name exactly vLLM's blocks of the prompt, once each, in chain order
    assert held["CPU"] == gpu, held
    assert held["STORAGE"] == gpu, held
    try:  # the sidecar's own channel names the same blocks as vLLM does
        from_sidecar = sidecar_stored(sidecar_sub, full, timeout_s=60)
    finally:
        sidecar_sub.close(linger=0)
        context.term()
    assert from_sidecar == {"CPU": gpu, "STORAGE": gpu}, (from_sidecar, gpu)
