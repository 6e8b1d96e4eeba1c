"""KV events against real `hicache serve` processes, read by a plain ZMQ SUB socket and decoded
with plain msgpack (that vLLM's own `KVEventBatch` decodes the same bytes, and that the hashes
are vLLM's, is `test_kv_wire.py`'s: it imports vLLM):
two engines' stores, LRU evictions and admin clears come out exactly (hashes — vLLM's for the
same tokens — and counts, per medium), a block several namespaces hold is stored and removed
once, and a subscriber that stops reading neither stalls the sidecar nor another subscriber.

A `Router` keeps what the events say each medium holds, as a KV-aware router would, and
checks each event against it as it comes (a block stored twice, or removed while not held,
fails at once). It waits for a state with a deadline, never a sleep: every event it awaits is
the consequence of an op the test has already seen answered."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.client import connect
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from hicache.service.kv_hashes import BlockHasher
from tests.conftest import REPO

zmq = pytest.importorskip("zmq", reason="pyzmq (the events extra) is not installed")
msgspec = pytest.importorskip("msgspec", reason="msgspec (the events extra) is not installed")

DEADLINE_S = 60.0
PAGE = 16
VOCAB = 128_000
PAGE_BYTES = 2 * 2 * 2 * 64 * 2 * PAGE  # layers x K,V x heads x head_dim x bf16 x tokens


def write_deploy(tmp_path: Path, storage: dict[str, Any], **kv_events: Any) -> Path:
    """A small attention model (one full-attention group, 16 KiB pages): L2 holds 16 pages."""
    data = {
        "model": {
            "model_type": "tiny",
            "layers": [{"repeat": 2, "kind": "full", "kv_heads": 2, "head_dim": 64}],
            "page_size_tokens": PAGE,
        },
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": 16 * PAGE_BYTES},
        "storage": storage,
        "service": {
            "socket_path": str(tmp_path / "e.sock"),
            "http_port": 0,
            "admin_without_token": True,
            # the 32-byte hashes, as `blocks` computes them (vLLM's default is the integers)
            "kv_events": {"endpoint": "tcp://127.0.0.1:0", "int_hashes": False, **kv_events},
        },
    }
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def serve() -> Iterator[Callable[[Path], SidecarProcess]]:
    started: list[SidecarProcess] = []

    def start(deploy: Path) -> SidecarProcess:
        started.append(SidecarProcess(deploy).start())
        return started[-1]

    yield start
    for proc in started:
        assert proc.stop() == 0, proc.log_path.read_text()


class Router:
    """A subscriber keeping, per medium, the blocks the events say are held."""

    def __init__(self, sidecar: SidecarProcess, rcvhwm: int = 100_000, subscribers: int = 1):
        self.sidecar = sidecar
        self.endpoint = sidecar.get_json("/v1/stats")["kv_events"]["endpoint"]
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.RCVHWM, rcvhwm)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(self.endpoint)
        self.held: dict[str, dict[bytes, tuple[bytes | None, list[int]]]] = {
            "CPU": {},
            "STORAGE": {},
        }
        self.stored = {"CPU": 0, "STORAGE": 0}  # block hashes stored, counted
        self.removed = {"CPU": 0, "STORAGE": 0}
        self.seqs: list[int] = []
        # once the sidecar has it, every later batch reaches this socket (no slow joiner)
        wait_until(lambda: self.subscriptions() == subscribers, "the sidecar to see it")

    def subscriptions(self) -> int:
        count: int = self.sidecar.get_json("/v1/stats")["kv_events"]["subscriptions"]
        return count

    def receive(self, timeout_ms: int) -> bool:
        if not self.socket.poll(timeout_ms):
            return False
        topic, seq, payload = self.socket.recv_multipart()
        assert topic == b""
        self.seqs.append(int.from_bytes(seq, "big"))
        assert self.seqs == sorted(set(self.seqs)), f"sequence not increasing: {self.seqs[-5:]}"
        ts, events = msgspec.msgpack.decode(payload)[:2]  # the array [ts, events, dp rank]
        assert isinstance(ts, float)
        for event in events:
            self.apply(event)
        return True

    def apply(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "AllBlocksCleared":
            for held in self.held.values():
                held.clear()
            return
        medium = event["medium"]
        held = self.held[medium]
        if kind == "BlockStored":
            assert event["block_size"] == PAGE
            tokens, parent = event["token_ids"], event["parent_block_hash"]
            assert len(tokens) == PAGE * len(event["block_hashes"])
            for i, block in enumerate(event["block_hashes"]):
                assert block not in held, f"{medium}: block {block.hex()} stored twice"
                held[block] = (parent, tokens[i * PAGE : (i + 1) * PAGE])
                parent = block
                self.stored[medium] += 1
        else:
            assert kind == "BlockRemoved", event
            for block in event["block_hashes"]:
                assert block in held, f"{medium}: block {block.hex()} removed but not held"
                del held[block]
                self.removed[medium] += 1

    def until(self, condition: Callable[[Router], bool], what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not condition(self):
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0, f"timed out waiting for {what}; held {self.summary()}"
            self.receive(min(left_ms, 500))

    def summary(self) -> dict[str, int]:
        return {medium: len(held) for medium, held in self.held.items()}

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def wait_until(condition: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling a state the sidecar reports; not a synchronisation


def prompts(seed: int, count: int, pages: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(pages * PAGE)] for _ in range(count)]


def blocks(tokens: list[int]) -> dict[bytes, tuple[bytes | None, list[int]]]:
    """What a router holds for these tokens: vLLM's hash of each full block, its parent and
    tokens (`BlockHasher` equals vLLM's `hash_block_tokens`, `test_kv_hashes.py`)."""
    hashes = BlockHasher("sha256").chain(tokens, PAGE)
    return {
        h: (hashes[i - 1] if i else None, tokens[i * PAGE : (i + 1) * PAGE])
        for i, h in enumerate(hashes)
    }


def clear(sidecar: SidecarProcess, tier: str) -> int:
    request = urllib.request.Request(
        f"{sidecar.http}/v1/admin/clear?tier={tier}", data=b"", method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        body: dict[str, Any] = json.loads(reply.read())
    return int(body.get("pages_dropped", body.get("pages_deleted", 0)))


def engine(sidecar: SidecarProcess, deploy: Path, tenant: str = "") -> Any:
    client = connect(
        sidecar.socket,
        load_deployment(deploy).layer_map(),
        page_size_tokens=PAGE,
        tenant=tenant,
        heartbeat=False,
    )
    client.register_pools(client.create_pools(8))
    return client


def store(client: Any, tokens: list[int]) -> dict[str, Any]:
    result: dict[str, Any] = client.store(tokens, {"full": list(range(len(tokens) // PAGE))})
    return result


def l2_pages(sidecar: SidecarProcess) -> int:
    return sum(
        ns["groups"]["full"]["l2_pages"] for ns in sidecar.get_json("/v1/stats")["namespaces"]
    )


def test_two_engines_stores_evictions_and_clears_come_out_exactly(
    tmp_path: Path, serve: Callable[[Path], SidecarProcess]
) -> None:
    # no L3: nothing pins a page for a persist, so L2 evicts in plain LRU order
    deploy = write_deploy(tmp_path, {"kind": "none"})
    sidecar = serve(deploy)
    router = Router(sidecar)
    a, b = engine(sidecar, deploy), engine(sidecar, deploy)
    other = engine(sidecar, deploy, tenant="other")  # another namespace, its own L2
    try:
        p = prompts(1, 7, 4)
        extended = p[0] + prompts(2, 1, 2)[0]  # B extends A's prompt by two pages
        assert store(a, p[0])["pages_stored"] == 4
        assert store(b, extended)["pages_stored"] == 2
        expected = blocks(extended)
        router.until(lambda r: r.held["CPU"] == expected, "the six blocks of both stores")
        assert router.stored["CPU"] == 6  # each block once, in chains vLLM's parents link
        for i, prompt in enumerate(p[1:]):  # 24 more pages: L2 (16) keeps the last four
            assert store((a, b)[i % 2], prompt)["pages_stored"] == 4
        expected = {h: v for prompt in p[3:] for h, v in blocks(prompt).items()}
        router.until(lambda r: r.held["CPU"] == expected, "the last sixteen pages held")
        assert (router.stored["CPU"], router.removed["CPU"]) == (30, 14)
        assert l2_pages(sidecar) == 16
        # the other namespace stores a block the first still holds (no event) and a new one
        marker = prompts(3, 1, 1)[0]
        assert store(other, p[6])["pages_stored"] == 4
        assert store(other, marker)["pages_stored"] == 1
        expected |= blocks(marker)
        router.until(lambda r: r.held["CPU"] == expected, "the other namespace's new block")
        assert router.stored["CPU"] == 31  # p[6] stored again elsewhere: no second event
        assert clear(sidecar, "l2") == 16 + 5  # both namespaces' L2
        router.until(lambda r: not r.held["CPU"], "every CPU block removed")
        assert (router.stored["CPU"], router.removed["CPU"]) == (31, 31)
        assert router.held["STORAGE"] == {}
        # the publisher thread counts a batch just after its send: the router can hold the
        # last one before the stats count it
        last = router.seqs[-1] + 1
        wait_until(
            lambda: sidecar.get_json("/v1/stats")["kv_events"]["batches_sent"] >= last,
            f"the stats to count the {last} batches the router saw",
        )
        stats = sidecar.get_json("/v1/stats")["kv_events"]
        assert stats["batches_sent"] == last  # nothing sent the router did not see
        assert stats["events_dropped"] == stats["batches_dropped"] == 0
        assert stats["blocks_held"] == {"CPU": 0, "STORAGE": 0}
        assert stats["pages_unhashed"] == 0
        metrics = urllib.request.urlopen(f"{sidecar.http}/metrics", timeout=10).read().decode()
        assert f'hicache_kv_event_batches_total{{outcome="sent"}} {stats["batches_sent"]}.0' in (
            metrics
        )
    finally:
        for client in (a, b, other):
            client.close()
        router.close()


def test_l3_persists_are_storage_blocks_and_each_clear_removes_its_medium(
    tmp_path: Path, serve: Callable[[Path], SidecarProcess]
) -> None:
    deploy = write_deploy(tmp_path, {"kind": "file", "path": str(tmp_path / "l3")})
    sidecar = serve(deploy)
    watch = docs_subscriber(tmp_path, sidecar)  # docs/engines.md's, as written
    router = Router(sidecar, subscribers=2)
    a, b = engine(sidecar, deploy), engine(sidecar, deploy)
    try:
        p = prompts(4, 2, 3)
        store(a, p[0])
        store(b, p[1])
        expected = blocks(p[0]) | blocks(p[1])
        # write-through: L3 holds them once each persist is acknowledged
        router.until(
            lambda r: r.held["CPU"] == expected and r.held["STORAGE"] == expected,
            "both prompts in L2 and L3",
        )
        assert clear(sidecar, "l2") == 6
        router.until(lambda r: not r.held["CPU"], "the CPU blocks removed")
        assert router.held["STORAGE"] == expected  # L3's copies stay, and the router knows
        assert clear(sidecar, "l3") == 6
        router.until(lambda r: not r.held["STORAGE"], "the STORAGE blocks removed")
        assert router.stored == router.removed == {"CPU": 6, "STORAGE": 6}
        last = f"seq={router.seqs[-1]} CPU=0 STORAGE=0"
        lines = read_until(watch, last)
        assert any(line.endswith("CPU=6 STORAGE=6") for line in lines), lines
    finally:
        for client in (a, b):
            client.close()
        router.close()
        watch.kill()
        watch.communicate(timeout=30)


def docs_subscriber(tmp_path: Path, sidecar: SidecarProcess) -> subprocess.Popen[str]:
    """docs/engines.md's minimal subscriber, run as written, once the sidecar counts it."""
    text = (REPO / "docs" / "engines.md").read_text()
    start = text.index("A minimal subscriber")
    code = text[text.index("```python\n", start) + len("```python\n") :]
    script = tmp_path / "kv_watch.py"
    script.write_text(code[: code.index("```")])
    endpoint = sidecar.get_json("/v1/stats")["kv_events"]["endpoint"]
    proc = subprocess.Popen(
        [sys.executable, str(script), endpoint], stdout=subprocess.PIPE, text=True
    )
    wait_until(
        lambda: sidecar.get_json("/v1/stats")["kv_events"]["subscriptions"] == 1,
        "the docs' subscriber to subscribe",
    )
    return proc


def read_until(proc: subprocess.Popen[str], last: str) -> list[str]:
    """The subscriber's lines up to `last` (it prints one per batch as it comes)."""
    assert proc.stdout is not None
    lines: list[str] = []
    while not lines or lines[-1] != last:
        line = proc.stdout.readline()
        assert line, f"the subscriber exited: {lines[-5:]}"
        lines.append(line.strip())
    return lines


def test_a_stalled_subscriber_slows_neither_the_sidecar_nor_another_subscriber(
    tmp_path: Path, serve: Callable[[Path], SidecarProcess]
) -> None:
    deploy = write_deploy(tmp_path, {"kind": "none"}, hwm=16)
    sidecar = serve(deploy)
    stalled = zmq.Context()
    sub = stalled.socket(zmq.SUB)  # subscribes, then never reads while the engine stores
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(sidecar.get_json("/v1/stats")["kv_events"]["endpoint"])
    router = Router(sidecar, subscribers=2)  # the live one, once the stalled one is counted
    client = engine(sidecar, deploy)
    try:
        p = prompts(5, 200, 1)
        for i, prompt in enumerate(p):
            assert store(client, prompt)["pages_stored"] == 1, f"store {i}"  # all answered
            block = next(iter(blocks(prompt)))
            router.until(lambda r, b=block: b in r.held["CPU"], f"store {i}'s block")
        expected = {h: v for prompt in p[-16:] for h, v in blocks(prompt).items()}
        router.until(lambda r: r.held["CPU"] == expected, "the live router's exact view")
        assert router.removed["CPU"] == 200 - 16
        live = router.seqs
        assert live == list(range(live[0], live[-1] + 1))  # the live one lost nothing
        got: list[int] = []
        while sub.poll(0):
            got.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        assert got == sorted(set(got))
        assert set(got) <= set(range(live[-1] + 1))
        # the publisher counts a batch once its send returned, which may be after the live
        # router received it: wait (bounded) for the count to reach what the router saw
        deadline = time.monotonic() + 60
        stats = sidecar.get_json("/v1/stats")["kv_events"]
        while stats["batches_sent"] < live[-1] + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
            stats = sidecar.get_json("/v1/stats")["kv_events"]
        # the sidecar queued nothing it could not hand on; what the stalled peer missed its
        # socket dropped (ZMQ's high-water mark), visible to it as gaps in seq
        assert stats["batches_dropped"] == 0
        assert stats["batches_sent"] == live[-1] + 1
        print(f"stalled subscriber received {len(got)} of {live[-1] + 1} batches")
    finally:
        client.close()
        router.close()
        sub.close(linger=0)
        stalled.term()


def test_an_endpoint_the_sidecar_cannot_bind_stops_its_start_naming_the_key(
    tmp_path: Path,
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
    deploy = write_deploy(tmp_path, {"kind": "none"}, endpoint=endpoint)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "hicache", "serve", "--config", str(deploy)],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=DEADLINE_S,
        )
    finally:
        taken.close()
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hicache: ")]
    assert "Traceback" not in proc.stderr
    assert len(errors) == 1, proc.stderr  # one line naming the key, the value and the cause
    assert errors[0].startswith(
        f"hicache: error: service.kv_events.endpoint '{endpoint}': cannot bind (Address already "
        "in use"
    ), errors[0]
    assert errors[0].endswith("); allowed: a free tcp://host:port or ipc:// path"), errors[0]
    assert not (tmp_path / "e.sock").exists()  # nothing left listening
