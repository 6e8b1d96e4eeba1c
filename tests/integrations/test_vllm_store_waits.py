"""The vLLM connector's scheduler half waiting for a prefill's store in flight without holding
vLLM's scheduler thread (`vllm/lookups.py`): `StepBook.matched` answers None ("ask again
later", what `get_num_new_matched_tokens` returns as (None, False)) while the sidecar says a
store writes the page past the hit, within `store_wait_s` of the request's first such ask.

Against the real engine server in-process (`SidecarWorld`, on an event loop of its own
thread: this test's thread plays vLLM's scheduler thread), the prefill's store held mid-copy
by the test (`test_store_waits.HeldBackups`), so "in flight" is a state the test sets. The
connector's lookup client is a thin adapter onto the world's dispatch (`WorldClient`: the
sidecar's keyers, its real `lookup_keys` op); the wait's clock is the test's (`Clock`), so
a bound passing is a step the test takes, never a sleep. Orderings: the store lands before
the first ask, between asks, never (timed_out), fails (missed), its producer dies mid-store
(it still lands: hit), the request finishes or is aborted while waiting (its state dropped,
abandoned), the sidecar goes while waiting (missed, no hits)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from hicache.client import ClientError, Lookup
from hicache.client.base import ClientBase
from hicache.integrations.vllm.lookups import Lookups
from hicache.integrations.vllm.plan import StepBook
from hicache.testing.sidecar_world import Engine, EngineError, SidecarWorld
from tests.service.test_store_waits import (
    PAGE,
    PAGES,
    HeldBackups,
    key_args,
    pair,
    prompt,
    settle,
    writing,
)

T = TypeVar("T")
WAIT_S = 2.0  # the connector's store_wait_s (the test's clock measures it)
ASKED = PAGES * PAGE  # the tokens `matched` asks about: all but a prompt's last token


def deployment(tmp_path: Path) -> Path:
    from tests.conftest import shared_model

    path = tmp_path / "deploy.yaml"
    path.write_text(
        f"model:\n  config_path: {shared_model('qwen2_7b.json')}\n  page_size_tokens: {PAGE}\n"
        "device:\n  kind: cpu\nhost:\n  capacity_bytes: 12MiB\nstorage:\n  kind: none\n"
        f"service:\n  socket_path: {tmp_path / 'e.sock'}\n  drain_timeout_s: 30\n"
    )
    return path


class WorldThread:
    """A `SidecarWorld` served on its own event loop thread, with a prefill and a decode
    engine and the prefill's backups held; `run` awaits a coroutine there."""

    def __init__(self, config: Path):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._stop = asyncio.Event()
        self.stores: list[concurrent.futures.Future[Any]] = []  # each store's end
        self._engines = 0
        self._served = asyncio.run_coroutine_threadsafe(self._serve(config), self.loop)
        self._ready.result(timeout=120)

    async def _serve(self, config: Path) -> None:
        try:
            async with SidecarWorld.running(config) as world:
                self.world = world
                self.held = HeldBackups(world)
                try:
                    self.prefill, self.decode = await pair(world)
                    self._ready.set_result(None)
                    await self._stop.wait()
                finally:
                    self.held.release()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            raise

    def run(self, make: Callable[[], Awaitable[T]]) -> T:
        async def call() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout=120)

    def store_in_flight(self, tokens: list[int]) -> concurrent.futures.Future[Any]:
        """The prefill's store of `tokens`, started and held mid-copy (its pages pending)."""

        async def start() -> asyncio.Task[Any]:
            task = asyncio.create_task(self.prefill.store(tokens))
            await settle(lambda: writing(self.world, self.prefill) == PAGES, "pages pending")
            return task

        task = self.run(start)

        async def ended() -> Any:
            return await asyncio.gather(task, return_exceptions=True)

        store = asyncio.run_coroutine_threadsafe(ended(), self.loop)
        self.stores.append(store)
        return store

    def release(self, *, fail: bool = False) -> int:
        """Run (or fail) the held store copies; how many."""

        async def release() -> int:
            return self.held.release(fail=fail)

        return self.run(release)

    def after_test(self) -> None:
        """What a test left, passed or failed: held copies run, stores ended, an engine
        whose connection it dropped replaced (its session ended first)."""
        self.release()
        for store in self.stores:
            store.result(timeout=120)
        self.stores.clear()

        async def replace() -> None:
            for role in ("prefill", "decode"):
                engine: Engine = getattr(self, role)
                if engine.link is not None and engine.link.closing:
                    if engine.session is not None and engine.session.ending is not None:
                        await engine.session.ending
                    self._engines += 1
                    fresh = self.world.engine(f"{role}{self._engines}", num_pages=8)
                    setattr(self, role, await fresh.start())

        self.run(replace)

    def lose(self, engine: Engine) -> None:
        """`engine`'s connection is lost (on the world's loop, as a real loss is seen)."""

        async def lose() -> None:
            assert engine.link is not None
            engine.link.abort()

        self.run(lose)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._served.result(timeout=120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


class WorldClient:
    """The connector's lookup client onto the world's decode engine: page keys from the
    sidecar's keyers, `lookup_keys` through its dispatch, the reply read as `Client` reads
    it. A lost connection raises as a socket's loss does (OSError)."""

    def __init__(self, world: WorldThread, engine: Engine):
        self.world, self.engine = world, engine
        self.asked: list[dict[str, Any]] = []

    def page_keys(self, tokens: Sequence[int], extend: Any = None) -> list[int]:
        return list(tokens)

    def lookup_keys(
        self, tokens: list[int], *, wait_stored_s: float = 0.0, answer_at_once: bool = False
    ) -> Lookup:
        args: dict[str, Any] = {"num_tokens": len(tokens)}
        if wait_stored_s > 0:
            args |= {"wait_stored_s": wait_stored_s, "answer_at_once": answer_at_once}
        self.asked.append(args)
        link = self.engine.link
        if link is None or link.closing:
            raise OSError("hicache sidecar: the connection was lost")

        async def call() -> dict[str, Any]:
            keys = key_args(self.world.world, self.engine, tokens)
            return await self.engine.call("lookup_keys", keys=keys, **args)

        try:
            reply = self.world.run(call)
        except EngineError as exc:
            raise ClientError(exc.code, exc.message) from exc
        return ClientBase._lookup_of(reply)

    def close(self) -> None:
        pass


@dataclass
class Clock:
    now_s: float = 100.0

    def __call__(self) -> float:
        return self.now_s


@dataclass
class Scheduler:
    """The connector's scheduler half without vLLM: `Lookups` and the `StepBook` over it, as
    `HicacheConnector` wires them (`get_num_new_matched_tokens` is `ask`)."""

    lookups: Lookups
    book: StepBook
    client: WorldClient
    clock: Clock

    def ask(self, req_id: str, tokens: list[int]) -> int | None:
        with self.lookups.asking(req_id):
            return self.book.matched(req_id, tokens, 0)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorldThread]:
    world = WorldThread(deployment(tmp_path_factory.mktemp("store_waits")))
    try:
        yield world
    finally:
        world.close()


@pytest.fixture
def world(served: WorldThread) -> Iterator[WorldThread]:
    """The module's world, left as the next test needs it whatever this one did."""
    yield served
    served.after_test()


def scheduler(world: WorldThread) -> Scheduler:
    client = WorldClient(world, world.decode)
    clock = Clock()
    lookups = Lookups(lambda: client, 1.0, wait_stored_s=WAIT_S, clock=clock)  # type: ignore[arg-type,return-value]
    return Scheduler(lookups, StepBook(PAGE, lookups.lookup, stores=False), client, clock)


def test_a_store_landed_before_the_first_ask_is_a_hit_without_waiting(
    world: WorldThread,
) -> None:
    s = scheduler(world)
    tokens = prompt(21)
    store = world.store_in_flight(tokens)
    assert world.release() == 1
    store.result(timeout=60)
    assert s.ask("r", tokens) == ASKED
    assert (s.lookups.store_waits, s.lookups.waiting) == ({}, {})
    # every ask a waiting lookup the sidecar answers at once
    assert s.client.asked == [
        {"num_tokens": len(tokens) - 1, "wait_stored_s": WAIT_S, "answer_at_once": True}
    ]


def test_a_store_landing_between_asks_is_a_hit(world: WorldThread, tmp_path: Path) -> None:
    s = scheduler(world)
    tokens = prompt(22)
    store = world.store_in_flight(tokens)
    assert s.ask("r", tokens) is None  # answered at once: ask again later
    s.clock.now_s += WAIT_S / 2
    assert s.ask("r", tokens) is None  # still written, still within the bound
    assert set(s.lookups.waiting) == {"r"}
    stats = tmp_path / "stats.scheduler.json"
    s.lookups.write_stats(stats)
    assert '"store_waits_waiting": 1' in stats.read_text()
    assert world.release() == 1
    store.result(timeout=60)
    assert s.ask("r", tokens) == ASKED
    assert (s.lookups.store_waits, s.lookups.waiting) == ({"hit": 1}, {})
    assert s.book.lookups == 1  # one answered lookup; the asks before it answered None
    assert world.world.server.state.store_waits.stats.waits == 0  # the sidecar held none


def test_a_store_outlasting_the_bound_times_out_with_the_hit_as_it_is(
    world: WorldThread,
) -> None:
    s = scheduler(world)
    tokens = prompt(23)
    store = world.store_in_flight(tokens)
    assert s.ask("r", tokens) is None
    s.clock.now_s += WAIT_S  # the bound passed, the store still held
    assert s.ask("r", tokens) == 0  # recomputed
    assert (s.lookups.store_waits, s.lookups.waiting) == ({"timed_out": 1}, {})
    assert world.release() == 1
    store.result(timeout=60)
    assert s.ask("r", tokens) == ASKED  # a later ask (a new wait would start afresh)
    assert s.lookups.store_waits == {"timed_out": 1}


def test_a_store_that_fails_ends_the_wait_missed(world: WorldThread) -> None:
    s = scheduler(world)
    tokens = prompt(24)
    store = world.store_in_flight(tokens)
    assert s.ask("r", tokens) is None
    assert world.release(fail=True) == 1
    [stored] = store.result(timeout=60)
    assert stored["pages_stored"] == 0
    assert s.ask("r", tokens) == 0
    assert (s.lookups.store_waits, s.lookups.waiting) == ({"missed": 1}, {})


def test_a_producer_dying_mid_store_still_lands_and_hits(world: WorldThread) -> None:
    """The sidecar's copy reads memory it mapped: the dead producer's store lands by itself
    (`service/store_waits.py`), so the decode's wait ends in a hit, not a miss."""
    s = scheduler(world)
    tokens = prompt(25)
    store = world.store_in_flight(tokens)
    assert s.ask("r", tokens) is None
    world.lose(world.prefill)  # the prefill engine dies (replaced after the test)
    assert s.ask("r", tokens) is None  # its store is still in flight
    assert world.release() == 1
    store.result(timeout=60)
    assert s.ask("r", tokens) == ASKED
    assert s.lookups.store_waits == {"hit": 1}


@pytest.mark.parametrize("how", ["finished", "aborted"])
def test_a_request_ended_while_waiting_drops_its_wait(world: WorldThread, how: str) -> None:
    """vLLM calls `request_finished` for a waiting request it aborts too (the connector's
    `_forget`): its wait state goes, counted abandoned; other requests' waits go on."""
    s = scheduler(world)
    tokens = prompt(26 if how == "finished" else 27)
    store = world.store_in_flight(tokens)
    assert s.ask("gone", tokens) is None
    assert s.ask("stays", tokens) is None
    s.lookups.forget("gone")
    s.book.finished("gone")
    assert set(s.lookups.waiting) == {"stays"}
    assert s.lookups.store_waits == {"abandoned": 1}
    s.lookups.forget("gone")  # forgotten twice (finished after an abort): counted once
    assert s.lookups.store_waits == {"abandoned": 1}
    assert world.release() == 1
    store.result(timeout=60)
    assert s.ask("stays", tokens) == ASKED
    assert (s.lookups.store_waits, s.lookups.waiting) == ({"abandoned": 1, "hit": 1}, {})


def test_the_sidecar_gone_while_waiting_ends_it_missed_with_no_hits(world: WorldThread) -> None:
    s = scheduler(world)
    tokens = prompt(28)
    world.store_in_flight(tokens)
    assert s.ask("r", tokens) is None
    world.lose(world.decode)  # the decode's connection is gone (replaced after the test)
    assert s.ask("r", tokens) == 0
    assert (s.lookups.store_waits, s.lookups.waiting) == ({"missed": 1}, {})
