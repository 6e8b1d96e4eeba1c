"""When a wait for a reply ends although what it waits for has not happened: a lookup's wait
for a store in flight (`service/store_waits.py`) and a store's wait for L3
(`persisted_within_s`, `cache/writing.until_persisted`), against the real engine server in
this process (`SidecarWorld`), with the store's backup walk or L3's writes held by the test,
so "still waiting" is a state, not a race.

Orderings: the asking engine's connection drops before the wait (no wait, uncounted) or
during it (the wait ends at once, counted `abandoned`, and its session ends without waiting
out the bound); the drain begins during a persist wait (answered `persisted: False` at once);
a `lookup_many`'s lookups wait together (one bound for the op, not one per lookup); a
persist wait is woken by the persist queue's batch ends, not by a timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from hicache.service import checkpoints
from hicache.testing.sidecar_world import Engine, SidecarWorld
from tests.conftest import shared_model
from tests.service.test_store_waits import (
    PAGE,
    PAGES,
    HeldBackups,
    config,  # noqa: F401  (the fixture)
    counted,
    in_flight,
    key_args,
    lookup,
    pair,
    prompt,
    run,
    settle,
    settled,
)


class HeldL3:
    """The world's L3 with its writes held until `release`: a persist batch in flight."""

    def __init__(self, world: SidecarWorld):
        self.l3 = world.l3
        self.gate = asyncio.Event()
        self.writes = 0  # write calls that reached L3 (held or not)
        self._put = world.l3.put_many
        world.l3.put_many = self._held_put  # type: ignore[method-assign]

    async def _held_put(self, items: Sequence[tuple[bytes, Any]]) -> list[bool]:
        self.writes += 1
        await self.gate.wait()
        return await self._put(items)

    def release(self) -> None:
        self.gate.set()


def persist_of(world: SidecarWorld, engine: Engine) -> Any:
    return world.server.namespaces[engine.key].cache.persist


async def persisting(world: SidecarWorld, prefill: Engine, tokens: list[int]) -> asyncio.Task[Any]:
    """The prefill's store with `persisted_within_s`, committed to L2 and waiting for L3 (its
    pages' batch held in L3's write)."""
    store = asyncio.create_task(
        prefill.call(
            "store",
            tokens=tokens,
            device_pages=prefill._pages(tokens, 0),
            persisted_within_s=30.0,
        )
    )
    await settle(lambda: persist_of(world, prefill).writing, "the store's pages being written")
    assert not store.done()
    return store


def test_decode_gone_during_the_wait_ends_it_at_once(config: Path) -> None:  # noqa: F811
    async def body(world: SidecarWorld) -> None:
        held = HeldBackups(world)
        prefill, decode = await pair(world)
        tokens = prompt(21)
        store = await in_flight(world, prefill, tokens)
        waiting = asyncio.create_task(lookup(world, decode, tokens, 30.0))
        await settle(lambda: counted(world)["waiting"] == 1, "the lookup waiting")
        assert decode.link is not None
        assert decode.session is not None
        decode.link.abort()  # the decode engine's connection is gone
        session = decode.session
        # within loop turns, the store still held: the wait ended on the connection's loss
        await settle(lambda: session.ending is not None and session.ending.done(), "ended")
        assert held.held, "the store was still held when the decode's session ended"
        stats = counted(world)
        assert (stats["waits"], stats["abandoned"], stats["waiting"]) == (1, 1, 0), stats
        assert (await waiting)["store_wait"] == "abandoned"
        held.release()
        assert (await store)["pages_stored"] == PAGES
        await settled(world)

    run(config, body)


def test_decode_gone_before_the_wait_does_not_wait(config: Path) -> None:  # noqa: F811
    async def body(world: SidecarWorld) -> None:
        held = HeldBackups(world)
        prefill, decode = await pair(world)
        tokens = prompt(22)
        store = await in_flight(world, prefill, tokens)
        namespace = world.server.namespaces[decode.key]
        gone = asyncio.Event()
        gone.set()  # the lookup's engine was gone by the time its wait would start
        keys = namespace.cache.index.keys(tokens)
        waits = world.server.state.store_waits
        wait = asyncio.create_task(waits.wait(namespace.cache, keys, 30.0, gone))
        await settle(wait.done, "answered without waiting for the held store")
        hit, outcome = wait.result()
        assert (hit.pages_total, outcome) == (0, None)
        assert counted(world)["waits"] == 0
        await settle(lambda: bool(held.held), "the store's walk held")
        held.release()
        await store

    run(config, body)


def test_producer_gone_during_a_persist_wait_ends_it_at_once(config: Path) -> None:  # noqa: F811
    """A producer whose store waits for L3 dies: its session ends while L3 is still held,
    not after `persisted_within_s`; the batch then lands, nothing left pinned."""

    async def body(world: SidecarWorld) -> None:
        l3 = HeldL3(world)
        prefill = await world.engine("prefill").start()
        tokens = prompt(23)
        store = await persisting(world, prefill, tokens)
        assert prefill.link is not None
        assert prefill.session is not None
        session = prefill.session
        prefill.link.abort()
        await settle(lambda: session.ending is not None and session.ending.done(), "ended")
        assert persist_of(world, prefill).writing, "L3's write was still held"
        reply = await store
        assert (reply["pages_stored"], reply["persisted"]) == (PAGES, False)
        l3.release()
        await persist_of(world, prefill).idle()
        assert await world.l3_missing(prefill.key, [tokens]) == 0
        await settled(world)

    run(config, body)


def test_drain_during_a_persist_wait_answers_not_persisted(config: Path) -> None:  # noqa: F811
    """The drain's start answers a persist wait (`persisted: False`) while the producer's
    connection is still up (before the drain drops the sessions, `drain.sessions`), with
    L3's write still held; the drain's flush then finishes the batch."""

    async def body(world: SidecarWorld) -> None:
        l3 = HeldL3(world)
        prefill = await world.engine("prefill").start()
        session = prefill.session
        assert session is not None
        tokens = prompt(24)
        store = await persisting(world, prefill, tokens)
        answered_while_connected: list[bool] = []

        async def at(name: str) -> None:
            if name == "drain.sessions":  # the sessions are dropped next
                for _ in range(1000):
                    if store.done():
                        break
                    await asyncio.sleep(0)
                answered_while_connected.append(store.done() and not session.gone.is_set())

        remove = checkpoints.install(at)
        try:
            drain = asyncio.create_task(world.drain())
            await settle(store.done, "the store answered")
        finally:
            remove()
        assert persist_of(world, prefill).writing, "L3's write was still held"
        reply = store.result()
        assert (reply["pages_stored"], reply["persisted"]) == (PAGES, False)
        assert answered_while_connected == [True]
        l3.release()  # the drain's flush finishes the batch
        await drain

    run(config, body)


def test_a_persist_wait_is_woken_by_batch_ends_not_a_timer(config: Path) -> None:  # noqa: F811
    """While L3's write is held nothing changes, so the wait looks at no page: no poll on the
    loop. Its batch's end wakes it, and the reply says the pages are in L3."""

    async def body(world: SidecarWorld) -> None:
        l3 = HeldL3(world)
        prefill = await world.engine("prefill").start()
        index = world.server.namespaces[prefill.key].cache.index
        looked_at = 0
        record = index.record

        def counting(group: str, key: Any) -> Any:
            nonlocal looked_at
            looked_at += 1
            return record(group, key)

        index.record = counting  # type: ignore[method-assign]
        tokens = prompt(25)
        store = await persisting(world, prefill, tokens)
        # the store's reply path reaches its wait within loop turns (no time passes): its
        # first look at the pages is counted before `before`
        for _ in range(100):
            await asyncio.sleep(0)
        before = looked_at
        # real time passing, not a synchronisation: a wait polling on a timer would look
        # the prompt's pages up again meanwhile
        await asyncio.sleep(0.2)
        assert looked_at == before, f"{looked_at - before} page look-ups while nothing changed"
        assert not store.done()
        l3.release()
        reply = await store
        assert (reply["pages_stored"], reply["persisted"]) == (PAGES, True)
        assert l3.writes == 1

    run(config, body)


def test_lookup_many_waits_for_all_its_lookups_at_once(config: Path) -> None:  # noqa: F811
    """Four lookups of one `lookup_many`, each with a wait, for a store held in flight: all
    four wait together (the op is bounded by one `wait_stored_s`, not four), and all hit
    once it lands."""

    async def body(world: SidecarWorld) -> None:
        held = HeldBackups(world)
        prefill, decode = await pair(world)
        tokens = prompt(26)
        store = await in_flight(world, prefill, tokens)
        one = {
            "keys": key_args(world, decode, tokens),
            "num_tokens": len(tokens),
            "wait_stored_s": 30.0,
        }
        many = asyncio.create_task(decode.call("lookup_many", lookups=[one] * 4))
        await settle(lambda: counted(world)["waiting"] == 4, "all four lookups waiting")
        held.release()
        reply = await many
        assert [(r["tokens_total"], r["store_wait"]) for r in reply["results"]] == [
            (PAGES * PAGE, "hit")
        ] * 4
        await store
        await settled(world)

    run(config, body)


def test_a_waiting_lookup_asks_l3_again_past_a_remembered_absent(tmp_path: Path) -> None:
    """Two hosts, one L3: the decode host's lookup of a prompt finds nothing in L3 (its
    "absent" answer remembered, here for 600 s); the prefill host then stores and persists
    it. A lookup with a wait (a decode instance's) asks L3 again and hits; one without
    trusts the remembered answer (one round trip per `l3_absent_ttl_s` for a cold prompt),
    and each key asked again is counted."""
    data = {
        "model": {"config_path": str(shared_model("qwen2_7b.json")), "page_size_tokens": PAGE},
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": "12MiB"},
        "storage": {"kind": "none"},
        "cache": {"l3_absent_ttl_s": 600},
        "service": {"socket_path": str(tmp_path / "e.sock"), "drain_timeout_s": 30},
    }
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))

    async def main() -> None:
        async with (
            SidecarWorld.running(path) as host_a,
            SidecarWorld.running(path, l3=host_a.l3) as host_b,
        ):
            prefill = await host_a.engine("prefill").start()
            decode = await host_b.engine("decode", num_pages=8).start()
            tokens = prompt(27)
            assert (await lookup(host_b, decode, tokens, 0.0))["tokens_total"] == 0
            reply = await prefill.store(tokens, persisted_within_s=30.0)
            assert reply["persisted"] is True
            discovery = host_b.server.namespaces[decode.key].cache.discovery
            # without a wait: L3's answer of moments ago is trusted, nothing asked
            assert (await lookup(host_b, decode, tokens, 0.0))["tokens_total"] == 0
            assert discovery.absent.asked_again == 0
            # with one (a decode instance): asked again, and found
            hit = await lookup(host_b, decode, tokens, 2.0)
            assert (hit["tokens_total"], "store_wait" in hit) == (PAGES * PAGE, False)
            assert discovery.absent.asked_again == PAGES * len(data_groups(host_b, decode))
            assert await decode.load(tokens) == PAGES * PAGE  # byte-exact, from L3

    asyncio.run(main())


def data_groups(world: SidecarWorld, engine: Engine) -> list[str]:
    return list(world.server.namespaces[engine.key].cache.index.keyers)
