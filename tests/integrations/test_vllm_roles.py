"""`kv_role` in the vLLM connector without vLLM: the roles and their refusal by name
(`vllm/roles.py`), `store_wait_s` checked, a consumer's steps storing nothing, a producer's
step ending only once its stores are answered (counted as in L2), and the scheduler half's
waits for stores in flight counted by outcome."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from hicache.channel.protocol import ErrorCode
from hicache.client import ClientError, Lookup
from hicache.errors import ConfigError
from hicache.integrations.vllm.lookups import Lookups
from hicache.integrations.vllm.plan import Scheduled, StepBook, StoreJob
from hicache.integrations.vllm.roles import CONSUMER_STORE_WAIT_S, ROLES, role_of
from hicache.integrations.vllm.settings import ConnectorSettings
from tests.integrations.test_vllm_units import _worker


def test_each_role_loads_and_only_the_consumer_never_stores() -> None:
    both, producer, consumer = (role_of(name) for name in ("kv_both", "kv_producer", "kv_consumer"))
    assert (both.loads, both.stores, both.acks_stores, both.default_store_wait_s) == (
        True,
        True,
        False,
        0,
    )
    assert (producer.loads, producer.stores, producer.acks_stores) == (True, True, True)
    assert producer.default_store_wait_s == 0
    assert (consumer.loads, consumer.stores, consumer.acks_stores) == (True, False, False)
    assert consumer.default_store_wait_s == CONSUMER_STORE_WAIT_S
    assert set(ROLES) == {"kv_both", "kv_producer", "kv_consumer"}


@pytest.mark.parametrize("value", ["kv_prefill", "", None, 3, "KV_BOTH"])
def test_an_unknown_role_is_refused_naming_it_where_from_and_the_roles(value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        role_of(value)
    message = str(caught.value)
    assert message.startswith(f"KVTransferConfig.kv_role: {value!r} is not a role")
    assert "allowed: kv_both, kv_producer, kv_consumer (kv_producer: the prefill" in message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, r"kv_connector_extra_config.store_wait_s: -1; seconds from 0 .* to 60"),
        (61, r"kv_connector_extra_config.store_wait_s: 61; seconds from 0"),
        ("long", r"kv_connector_extra_config.store_wait_s: 'long'; seconds from 0"),
        (True, r"kv_connector_extra_config.store_wait_s: True; seconds from 0"),
    ],
)
def test_store_wait_errors_name_the_key_value_and_range(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ConnectorSettings.parse({"address": "s", "store_wait_s": value})


def test_store_wait_unset_leaves_it_to_the_role() -> None:
    assert ConnectorSettings.parse({"address": "s"}).store_wait_s is None
    assert ConnectorSettings.parse({"address": "s", "store_wait_s": 0}).store_wait_s == 0.0
    assert ConnectorSettings.parse({"address": "s", "store_wait_s": 2.5}).store_wait_s == 2.5


def test_a_consumers_steps_load_but_never_store() -> None:
    def lookup(tokens: Any) -> tuple[int, int]:
        return 8, 8

    tokens = list(range(13))
    steps = {}
    for stores in (True, False):
        book = StepBook(4, lookup, stores=stores)
        book.matched("r", tokens, 0)
        book.allocated("r", tokens, 0, 8, [[5, 6, 7, 8]])
        prefill = book.step([Scheduled("r", tokens, 8, 5, [[5, 6, 7, 8]])])
        decode = book.step([Scheduled("r", [*tokens, 13, 14, 15], 13, 1, [[5, 6, 7, 8]])])
        steps[stores] = (prefill, decode)
    # the same loads either way; the stores only where the role stores
    assert steps[True][0].loads == steps[False][0].loads != []
    assert [len(s.stores) for s in steps[True]] == [1, 0]
    assert [s.stores for s in steps[False]] == [[], []]


def test_a_producers_step_ends_with_its_stores_answered_and_counted_in_l2() -> None:
    worker, client = _worker(staging_pages=4, direct=True)
    client.store_gate = threading.Event()
    worker.store([StoreJob("a", tuple(range(32)), 0, ((1, 2, 0),), 32)])  # sent, not waited
    assert client.stores_finished == 0
    ended: list[int] = []

    def wait_for_save_end() -> None:
        worker.await_stores()
        ended.append(client.stores_finished)

    step = threading.Thread(target=wait_for_save_end)
    step.start()
    assert client.store_entered.wait(timeout=60)
    assert ended == []  # the step has not ended while the store is unanswered
    client.store_gate.set()
    step.join(timeout=60)
    assert ended == [1]
    assert (worker.counters.stores, worker.counters.stores_in_l2) == (1, 1)
    assert worker.counters.stores_truncated == 0


class _WaitingClient:
    """A lookup client whose replies say how a wait for a store in flight ended."""

    def __init__(self, outcomes: list[str | None]):
        self.outcomes = outcomes
        self.waits: list[float] = []
        self.at_once: list[bool] = []

    def page_keys(self, tokens: Any, extend: Any = None) -> list[int]:
        return list(tokens)

    def lookup_keys(
        self, keys: Any, *, wait_stored_s: float = 0.0, answer_at_once: bool = False
    ) -> Lookup:
        self.waits.append(wait_stored_s)
        self.at_once.append(answer_at_once)
        outcome = self.outcomes.pop(0)
        return Lookup(4, 8, 8 if outcome == "hit" else 0, outcome)


def test_lookups_ask_with_the_wait_and_count_each_outcome(tmp_path: Path) -> None:
    """Replies of a sidecar that waited (a blocking wait, `store_wait`): counted alike."""
    client = _WaitingClient(["hit", None, "timed_out", "hit"])
    lookups = Lookups(lambda: client, 1.0, wait_stored_s=2.5)  # type: ignore[arg-type,return-value]
    hits = [lookups.lookup(list(range(12))) for _ in range(4)]
    assert client.waits == [2.5] * 4
    assert client.at_once == [True] * 4  # never asked to hold the reply
    assert hits == [(8, 8), (8, 0), (8, 0), (8, 8)]
    assert lookups.store_waits == {"hit": 2, "timed_out": 1}
    path = tmp_path / "stats.scheduler.json"
    lookups.write_stats(path, kv_role="kv_consumer")
    assert json.loads(path.read_text()) == {
        "kv_role": "kv_consumer",
        "store_wait_s": 2.5,
        "store_waits": {"hit": 2, "timed_out": 1},
        "store_waits_waiting": 0,
    }


def test_only_a_producer_may_wait_for_l3() -> None:
    from hicache.integrations.vllm.roles import check_persisted

    check_persisted(role_of("kv_producer"), 30.0)
    for name in ("kv_both", "kv_consumer"):
        check_persisted(role_of(name), 0.0)
        with pytest.raises(ConfigError) as caught:
            check_persisted(role_of(name), 30.0)
        assert str(caught.value).startswith(
            f"kv_connector_extra_config.persisted_within_s: 30 with KVTransferConfig.kv_role "
            f"{name!r}; only kv_producer"
        )
    with pytest.raises(ConfigError, match=r"persisted_within_s: 61; seconds from 0"):
        ConnectorSettings.parse({"address": "s", "persisted_within_s": 61})
    assert ConnectorSettings.parse({"address": "s"}).persisted_within_s == 0.0


def test_a_store_reply_saying_persisted_is_counted() -> None:
    worker, client = _worker(staging_pages=4, direct=True)
    replies = iter([{"persisted": True}, {"persisted": False}, {}])
    client.store = lambda *args, **kwargs: next(replies)  # type: ignore[method-assign]
    for i in range(3):
        worker.store([StoreJob(f"r{i}", tuple(range(32)), 0, ((1, 2, 0),), 32)])
        worker.await_stores()
    counters = worker.counters
    assert (counters.stores_persisted, counters.stores_not_persisted) == (1, 1)
    assert counters.stores_in_l2 == 3


class _OlderSidecar(_WaitingClient):
    """A sidecar that predates some lookup fields: it refuses each by name, as pydantic
    lists every extra field of a request."""

    def __init__(self, outcomes: list[str | None], lacks: tuple[str, ...]):
        super().__init__(outcomes)
        self.lacks = lacks

    def lookup_keys(
        self, keys: Any, *, wait_stored_s: float = 0.0, answer_at_once: bool = False
    ) -> Lookup:
        sent = {"wait_stored_s": wait_stored_s, "answer_at_once": answer_at_once}
        refused = [
            f"lookup_keys.{name}: Extra inputs are not permitted (got {value})"
            for name, value in sent.items()
            if value and name in self.lacks
        ]
        if refused:
            raise ClientError(ErrorCode.BAD_REQUEST, "; ".join(refused))
        return super().lookup_keys(keys, wait_stored_s=wait_stored_s, answer_at_once=answer_at_once)


def test_an_older_sidecar_is_asked_without_the_wait_from_then_on() -> None:
    client = _OlderSidecar([None, None], ("wait_stored_s", "answer_at_once"))
    lookups = Lookups(lambda: client, 1.0, wait_stored_s=2.0)  # type: ignore[arg-type,return-value]
    assert lookups.lookup(list(range(12))) == (8, 0)  # answered, not an outage
    assert lookups.wait_stored_s == 0.0
    assert lookups.lookup(list(range(12))) == (8, 0)
    assert client.waits == [0.0, 0.0]


def test_a_sidecar_without_answers_at_once_is_waited_on_there_from_then_on() -> None:
    """The blocking wait kept for a sidecar that predates `answer_at_once`: asked with the
    wait alone (it holds the reply), its outcomes counted as its replies say."""
    client = _OlderSidecar(["hit", "timed_out"], ("answer_at_once",))
    lookups = Lookups(lambda: client, 1.0, wait_stored_s=2.0)  # type: ignore[arg-type,return-value]
    with lookups.asking("r"):
        assert lookups.lookup(list(range(12))) == (8, 8)
        assert lookups.lookup(list(range(12))) == (8, 0)
    assert not lookups.answer_at_once
    assert (client.waits, client.at_once) == ([2.0, 2.0], [False, False])
    assert lookups.store_waits == {"hit": 1, "timed_out": 1}
    assert lookups.waiting == {}


def test_an_older_sidecar_refusing_persisted_is_asked_at_l2_from_then_on() -> None:
    worker, client = _worker(staging_pages=4, direct=True)
    worker.stores.persisted_within_s = 30.0
    asked: list[float] = []

    def store(*args: Any, persisted_within_s: float = 0.0, **kwargs: Any) -> dict[str, Any]:
        asked.append(persisted_within_s)
        if persisted_within_s:
            raise ClientError(
                ErrorCode.BAD_REQUEST,
                "store.persisted_within_s: Extra inputs are not permitted (got 30.0)",
            )
        return {}

    client.store = store  # type: ignore[method-assign]
    for i in range(2):
        worker.store(
            [StoreJob(f"r{i}", tuple(range(32)), 0, ((1, 2, 0),), 32, completes_prompt=True)]
        )
        worker.await_stores()
    assert asked == [30.0, 0.0, 0.0]
    counters = worker.counters
    assert (counters.stores, counters.store_failures, counters.stores_in_l2) == (2, 0, 2)
    assert "the sidecar predates it" in counters.errors[-1]


def test_only_the_store_completing_a_prompt_asks_for_l3() -> None:
    """`persisted_within_s` holds a producer's step on L3: only the store that reaches the
    prompt's last whole page asks for it — not an earlier chunk's, not a later step's."""

    def lookup(tokens: Any) -> tuple[int, int]:
        return 0, 0

    def chunks(prompt_len: int, sizes: list[int]) -> list[list[tuple[int, bool]]]:
        """Per step, each store's (first page, completes_prompt), chunks of `sizes` tokens
        then one decode step."""
        tokens = list(range(prompt_len))
        blocks = [list(range(1, prompt_len // 4 + 3))]
        book = StepBook(4, lookup, stores=True)
        book.matched("r", tokens, 0)
        book.allocated("r", tokens, 0, 0, blocks)
        steps, done = [], 0
        for size in [*sizes, 1]:  # the last: the first decode step (one output token)
            if done == prompt_len:
                tokens.append(1000 + done)
            step = book.step(
                [Scheduled("r", list(tokens), done, size, blocks, prompt_tokens=prompt_len)]
            )
            steps.append([(job.first_page, job.completes_prompt) for job in step.stores])
            done += size
        return steps

    # 3 chunks of 8 tokens (2 pages each); the decode step adds no whole page yet
    assert chunks(24, [8, 8, 8]) == [[(0, False)], [(2, False)], [(4, True)], []]
    # the last chunk adds no whole page (26 tokens: 6 whole pages, the chunk before has them)
    assert chunks(26, [16, 8, 2]) == [[(0, False)], [(4, True)], [], []]
    # without a prompt length (an older caller): no store asks
    book = StepBook(4, lookup, stores=True)
    book.allocated("q", list(range(8)), 0, 0, [[1, 2]])
    step = book.step([Scheduled("q", list(range(8)), 0, 8, [[1, 2]])])
    assert [job.completes_prompt for job in step.stores] == [False]


def test_a_chunk_that_does_not_complete_its_prompt_is_answered_at_l2() -> None:
    worker, client = _worker(staging_pages=4, direct=True)
    worker.stores.persisted_within_s = 30.0
    asked: list[float] = []

    def store(*args: Any, persisted_within_s: float = 0.0, **kwargs: Any) -> dict[str, Any]:
        asked.append(persisted_within_s)
        return {"persisted": True} if persisted_within_s else {}

    client.store = store  # type: ignore[method-assign]
    worker.store([StoreJob("a", tuple(range(32)), 0, ((1, 2, 0),), 32)])  # an earlier chunk
    worker.await_stores()
    worker.store(
        [StoreJob("a", tuple(range(32)), 0, ((1, 2, 0),), 32, completes_prompt=True)]
    )  # the last
    worker.await_stores()
    assert asked == [0.0, 30.0]
    assert worker.counters.stores_persisted == 1


def test_each_clients_reply_timeout_outlasts_only_its_own_waits() -> None:
    from hicache.integrations.vllm.roles import REPLY_MARGIN_S, reply_timeout_s

    waits = {"load_timeout_s": 10.0, "store_wait_s": 2.0, "persisted_within_s": 30.0}
    # the scheduler's lookups: their store wait only, never a load's or L3's bound
    assert reply_timeout_s("lookup", **waits) == REPLY_MARGIN_S + 2.0
    assert reply_timeout_s("engine", **waits) == REPLY_MARGIN_S + 30.0
    # kv_both with no waits: the lookup's margin, the worker's load timeout, as before roles
    none = {"load_timeout_s": 10.0, "store_wait_s": 0.0, "persisted_within_s": 0.0}
    assert (reply_timeout_s("lookup", **none), reply_timeout_s("engine", **none)) == (5.0, 10.0)
