"""`KvEvents` over real `PrefixIndex`es with a recording publisher in place of the ZMQ one: every
tier change of a page in every order (stored, persisted, evicted, fetched back, forgotten,
cleared), two namespaces holding one block, two stores naming one page, coalescing into
vLLM-style chains; and the real `ZmqEventPublisher`'s bounded queue (a full one drops and
counts), its replay buffer (the last `buffer_steps` batches, then the end marker) and its
refusals by name (missing packages, an endpoint or replay endpoint it cannot bind, bad ones)."""

from __future__ import annotations

import asyncio
import builtins
import threading
import time
from typing import Any

import pytest
import yaml

from hicache.config import load_deployment
from hicache.errors import ConfigError
from hicache.index import PrefixIndex
from hicache.service.kv_events import KvEvents
from hicache.service.kv_hashes import BlockHasher
from hicache.service.kv_publisher import Event, PublisherStats
from tests.index.test_index import make_index

PAGE = 4
HASHER = BlockHasher()


class Recorder:
    """Takes batches as the ZMQ publisher would, and keeps them."""

    endpoint = "tcp://recorder"
    replay_endpoint = None

    def __init__(self) -> None:
        self.batches: list[list[Event]] = []

    def submit(self, events: list[Event]) -> bool:
        self.batches.append(events)
        return True

    def stats(self) -> PublisherStats:
        return PublisherStats(len(self.batches), sum(map(len, self.batches)), 0, 0, 0, 0)

    def close(self) -> None:
        pass

    def events(self) -> list[Event]:
        """Every event after the start's AllBlocksCleared, the batches flattened."""
        flat = [e for batch in self.batches for e in batch]
        assert flat[0] == ("cleared",)
        return flat[1:]

    def take(self) -> list[Event]:
        taken = self.events()
        del self.batches[1:]
        return taken


def setup(*indexes: PrefixIndex) -> tuple[KvEvents, Recorder]:
    recorder = Recorder()
    events = KvEvents(recorder, HASHER, PAGE)  # type: ignore[arg-type]
    for index in indexes:
        events.watch(index)
    return events, recorder


def stored(medium: str, tokens: list[int], first: int = 0) -> Event:
    """The BlockStored of `tokens`' full blocks from block `first` on."""
    hashes = HASHER.chain(tokens, PAGE)
    parent = hashes[first - 1] if first else None
    return ("stored", medium, hashes[first:], parent, tokens[first * PAGE :], PAGE)


def store(index: PrefixIndex, tokens: list[int]) -> list[bytes]:
    """What a store does to the index: its keys pending while each page is inserted."""
    keys = index.keys(tokens)["full"]
    with index.watcher.storing(tokens):  # type: ignore[attr-defined]
        for i, key in enumerate(keys):
            if index.record("full", key) is None or index.record("full", key).l2_page is None:  # type: ignore[union-attr]
                index.insert_l2("full", key, 100 + i)
    return keys


def llama(capacity: int = 8, l3_only: int = 64) -> PrefixIndex:
    return make_index("llama-3.1-8b.json", capacity=capacity, page=PAGE, l3_only=l3_only)


def test_a_page_through_every_tier_change_in_order() -> None:
    index = llama()
    events, rec = setup(index)
    tokens = list(range(100, 100 + 3 * PAGE))
    keys = store(index, tokens)
    h = HASHER.chain(tokens, PAGE)
    # outside an event loop each page's event is its own batch
    assert rec.take() == [stored("CPU", tokens[: (i + 1) * PAGE], i) for i in range(3)]
    index.mark_l3_many("full", keys)
    assert rec.take() == [stored("STORAGE", tokens[: (i + 1) * PAGE], i) for i in range(3)]
    index.mark_l3_many("full", keys)  # already held: nothing
    index.drop_l2("full", keys[2])  # evicted; L3 keeps it
    assert rec.take() == [("removed", "CPU", [h[2]])]
    index.insert_l2("full", keys[2], 7)  # fetched back from L3: its tokens are remembered
    assert rec.take() == [stored("CPU", tokens, 2)]
    index.drop_l3("full", keys[0])
    assert rec.take() == [("removed", "STORAGE", [h[0]])]
    index.drop_l2("full", keys[0])  # no tier holds it: removed, then forgotten
    assert rec.take() == [("removed", "CPU", [h[0]])]
    index.insert_l2("full", keys[0], 9)  # back without a store naming its tokens: no hash
    assert rec.take() == []
    assert events.pages_unhashed == 1
    assert events.stats()["blocks_held"] == {"CPU": 2, "STORAGE": 2}


def test_l3_only_pages_the_index_forgets_are_removed() -> None:
    index = llama(l3_only=2)
    events, rec = setup(index)
    tokens = list(range(4 * PAGE))
    keys = store(index, tokens)
    index.mark_l3_many("full", keys)
    h = HASHER.chain(tokens, PAGE)
    rec.take()
    for key in keys:
        index.drop_l2("full", key)  # L3-only beyond the bound of 2: the oldest forgotten
    assert rec.take() == [
        ("removed", "CPU", [h[0]]),
        ("removed", "CPU", [h[1]]),
        ("removed", "CPU", [h[2]]),
        ("removed", "STORAGE", [h[0]]),
        ("removed", "CPU", [h[3]]),
        ("removed", "STORAGE", [h[1]]),
    ]
    assert events.stats()["blocks_held"] == {"CPU": 0, "STORAGE": 2}


def test_a_block_two_namespaces_hold_is_stored_once_and_removed_with_the_last() -> None:
    first, second = llama(), llama()
    _, rec = setup(first, second)
    tokens = list(range(2 * PAGE))
    h = HASHER.chain(tokens, PAGE)
    keys_a = store(first, tokens)
    keys_b = store(second, tokens[:PAGE])
    assert rec.take() == [stored("CPU", tokens[:PAGE]), stored("CPU", tokens, 1)]
    first.drop_l2("full", keys_a[0])  # the second still holds block 0
    first.drop_l2("full", keys_a[1])  # no one else holds block 1
    assert rec.take() == [("removed", "CPU", [h[1]])]
    second.drop_l2("full", keys_b[0])
    assert rec.take() == [("removed", "CPU", [h[0]])]


def test_two_stores_naming_one_page_keep_its_tokens_until_both_end() -> None:
    index = llama()
    _, rec = setup(index)
    tokens = list(range(2 * PAGE))
    keys = index.keys(tokens)["full"]
    watcher: Any = index.watcher
    with watcher.storing(tokens):
        with watcher.storing(tokens[:PAGE]):
            pass  # the shorter store ends first, having inserted nothing
        index.insert_l2("full", keys[0], 1)
        index.insert_l2("full", keys[1], 2)
    assert rec.take() == [stored("CPU", tokens[:PAGE]), stored("CPU", tokens, 1)]
    assert watcher._active == []  # nothing pending once both ended


def test_one_turn_of_the_loop_is_one_batch_of_vllm_style_chains() -> None:
    index = llama()
    _, rec = setup(index)
    a, b = list(range(3 * PAGE)), list(range(500, 500 + PAGE))

    async def run() -> None:
        keys = store(index, a) + store(index, b)
        for key in keys[:2]:
            index.drop_l2("full", key)
        await asyncio.sleep(0)  # the flush scheduled by the first event runs

    asyncio.run(run())
    ha, hb = HASHER.chain(a, PAGE), HASHER.chain(b, PAGE)
    assert rec.batches[1:] == [
        [stored("CPU", a), stored("CPU", b), ("removed", "CPU", [ha[0], ha[1]])]
    ]
    assert hb  # b's chain is its own (parent None), not appended to a's


def test_a_full_queue_drops_the_batch_and_counts_it() -> None:
    pytest.importorskip("zmq", reason="pyzmq (the events extra) is not installed")
    pytest.importorskip("msgspec", reason="msgspec (the events extra) is not installed")
    from hicache.service.kv_publisher import ZmqEventPublisher

    class Gated(ZmqEventPublisher):
        gate = threading.Event()
        entered = threading.Event()

        def encode(self, events: list[Event], ts: float) -> bytes:
            self.entered.set()
            self.gate.wait()
            return super().encode(events, ts)

    publisher = Gated("tcp://127.0.0.1:0", "t", queue_depth=2, hwm=10)
    try:
        assert publisher.submit([("cleared",)])
        assert publisher.entered.wait(30)  # the thread holds batch 1; 2 fill the queue
        assert publisher.submit([("cleared",)])
        assert publisher.submit([("cleared",)] * 2)
        assert not publisher.submit([("cleared",)] * 3)
        s = publisher.stats()
        assert (s.batches_dropped, s.events_dropped, s.queued_batches) == (1, 3, 2)
    finally:
        Gated.gate.set()
        publisher.close()  # sends what is queued, then stops
    s = publisher.stats()
    assert (s.batches_sent, s.events_sent, s.batches_dropped) == (3, 4, 1)
    assert not publisher.submit([("cleared",)])  # closed: refused


def test_missing_packages_are_refused_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache.service.kv_publisher import load_publisher_deps

    real = builtins.__import__

    def without_zmq(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "zmq":
            raise ImportError("No module named 'zmq'", name="zmq")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_zmq)
    with pytest.raises(
        ConfigError,
        match=r"^service.kv_events needs pyzmq and msgspec \(zmq is not installed\); install "
        r"the events extra \(pip install 'hicache\[events\]'\) or leave service.kv_events out$",
    ):
        load_publisher_deps()


def test_an_endpoint_in_use_is_refused_by_name() -> None:
    pytest.importorskip("zmq", reason="pyzmq (the events extra) is not installed")
    pytest.importorskip("msgspec", reason="msgspec (the events extra) is not installed")
    from hicache.service.kv_publisher import ZmqEventPublisher

    first = ZmqEventPublisher("tcp://127.0.0.1:0", "", queue_depth=1, hwm=1)
    try:
        with pytest.raises(
            ConfigError,
            match=rf"^service.kv_events.endpoint '{first.endpoint}': cannot bind \(Address "
            r"already in use.*\); allowed: a free tcp://host:port or ipc:// path$",
        ):
            ZmqEventPublisher(first.endpoint, "", queue_depth=1, hwm=1)
    finally:
        first.close()


def test_a_bad_endpoint_is_refused_in_the_deployment(tmp_path: Any) -> None:
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump({"service": {"kv_events": {"endpoint": "udp://x:1"}}}))
    with pytest.raises(ConfigError, match=r"service\.kv_events\.endpoint.*'udp://x:1' is no ZMQ"):
        load_deployment(path, env={})


def test_replay_keeps_the_last_buffer_steps_batches_and_ends_with_the_marker() -> None:
    zmq = pytest.importorskip("zmq", reason="pyzmq (the events extra) is not installed")
    pytest.importorskip("msgspec", reason="msgspec (the events extra) is not installed")
    from hicache.service.kv_publisher import END_SEQ, ZmqEventPublisher

    publisher = ZmqEventPublisher(
        "tcp://127.0.0.1:0", "t", 8, 8, replay_endpoint="tcp://127.0.0.1:0", buffer_steps=2
    )
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        assert publisher.replay_endpoint is not None
        dealer.connect(publisher.replay_endpoint)
        for _ in range(4):  # nobody subscribed: the PUB drops them, the buffer keeps 2
            assert publisher.submit([("cleared",)])
        deadline = time.monotonic() + 30
        while publisher.stats().batches_sent < 4:
            assert time.monotonic() < deadline, publisher.stats()
            time.sleep(0.01)  # polling the publisher's own count; not a synchronisation
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        frames = []
        while not frames or frames[-1][2] != END_SEQ:
            assert dealer.poll(30_000), frames
            frames.append(dealer.recv_multipart())
        assert [(f[1], int.from_bytes(f[2], "big", signed=True)) for f in frames] == [
            (b"t", 2),
            (b"t", 3),
            (b"", -1),
        ]
        assert frames[-1][3] == b""
        assert publisher.stats().replays == 1
    finally:
        dealer.close(linger=0)
        context.term()
        publisher.close()


def test_a_replay_endpoint_in_use_is_refused_by_name() -> None:
    pytest.importorskip("zmq", reason="pyzmq (the events extra) is not installed")
    pytest.importorskip("msgspec", reason="msgspec (the events extra) is not installed")
    from hicache.service.kv_publisher import ZmqEventPublisher

    first = ZmqEventPublisher("tcp://127.0.0.1:0", "", queue_depth=1, hwm=1)
    try:
        with pytest.raises(
            ConfigError,
            match=rf"^service.kv_events.replay_endpoint '{first.endpoint}': cannot bind "
            r"\(Address already in use.*\); allowed: a free tcp://host:port or ipc:// path "
            r"other than service.kv_events.endpoint$",
        ):
            ZmqEventPublisher(
                "tcp://127.0.0.1:0", "", queue_depth=1, hwm=1, replay_endpoint=first.endpoint
            )
    finally:
        first.close()


@pytest.mark.parametrize(
    ("kv_events", "message"),
    [
        (
            {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5557"},
            r"service\.kv_events.*replay_endpoint 'tcp://127\.0\.0\.1:5557' is the endpoint "
            r"too; allowed: another address",
        ),
        (
            {"replay_endpoint": "udp://x:2"},
            r"service\.kv_events\.replay_endpoint.*'udp://x:2' is no ZMQ endpoint",
        ),
        ({"buffer_steps": 0}, r"service\.kv_events\.buffer_steps"),
    ],
    ids=["same-as-endpoint", "not-zmq", "no-buffer"],
)
def test_bad_replay_settings_are_refused_in_the_deployment(
    tmp_path: Any, kv_events: dict[str, Any], message: str
) -> None:
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump({"service": {"kv_events": kv_events}}))
    with pytest.raises(ConfigError, match=message):
        load_deployment(path, env={})


@pytest.mark.parametrize(
    "model", ["gemma3_27b.json", "nemotron_h_8b.json", "qwen3_next_80b.json", "lfm2_350m.json"]
)
def test_a_hybrids_full_group_is_the_one_published_with_vllms_hashes(model: str) -> None:
    """Every hybrid among the real configs has one whole-prefix group (full attention) beside
    windows or states: its pages are published; the other group's changes publish nothing."""
    index = make_index(model, capacity=8, page=PAGE, l3_only=64)
    assert [g for g, r in index.rules.items() if r.needs_whole_prefix] == ["full"]
    [other] = [g for g in index.rules if g != "full"]
    events, rec = setup(index)
    tokens = list(range(200, 200 + 2 * PAGE))
    keys = index.keys(tokens)
    with index.watcher.storing(tokens):  # type: ignore[attr-defined]
        index.insert_l2(other, keys[other][-1], 0)  # the window's / state's page
        for i, key in enumerate(keys["full"]):
            index.insert_l2("full", key, 10 + i)
    assert rec.take() == [stored("CPU", tokens[: (i + 1) * PAGE], i) for i in range(2)]
    index.drop_l2(other, keys[other][-1])
    assert rec.take() == []
    assert events.pages_unhashed == 0
