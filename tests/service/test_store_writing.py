"""A lookup reply's `store_writing`: whether a store in flight writes the page right past the
hit, said at once (`service/store_waits.py` `writing` / `writing_tokens`, the same
`writing_after` a held wait uses), for `lookup_keys`, `lookup_many` and `lookup` by tokens;
and `KeyLookup.answer_at_once`: a lookup with `wait_stored_s` that the sidecar never holds
(vLLM's connector asks again itself), still a waiting lookup for discovery. Against the
real engine server in-process (`SidecarWorld`) with the store's backup walk held by the test
(`test_store_waits.HeldBackups`): every ordering — nothing in flight, in flight, landed,
failed, the drain."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from hicache.service.ops_lookup import Query
from hicache.testing.sidecar_world import Engine, SidecarWorld
from tests.service.test_store_waits import (
    PAGE,
    PAGES,
    HeldBackups,
    config,  # noqa: F401  (the deployment fixture)
    counted,
    in_flight,
    key_args,
    pair,
    prompt,
    run,
    settle,
)


async def at_once(world: SidecarWorld, engine: Engine, tokens: list[int]) -> dict[str, Any]:
    """The connector's ask: a waiting lookup the sidecar must not hold."""
    return await engine.call(
        "lookup_keys",
        keys=key_args(world, engine, tokens),
        num_tokens=len(tokens),
        wait_stored_s=30.0,
        answer_at_once=True,
    )


async def replies(world: SidecarWorld, engine: Engine, tokens: list[int]) -> list[dict[str, Any]]:
    """The same prompt asked every way: by keys at once, plain by keys, in a lookup_many, by
    tokens."""
    keys = key_args(world, engine, tokens)
    many = await engine.call("lookup_many", lookups=[{"keys": keys, "num_tokens": len(tokens)}])
    return [
        await at_once(world, engine, tokens),
        await engine.call("lookup_keys", keys=keys, num_tokens=len(tokens)),
        many["results"][0],
        await engine.call("lookup", tokens=tokens),
    ]


def test_a_store_in_flight_is_said_at_once_and_its_landing_ends_it(config: Path) -> None:  # noqa: F811
    async def body(world: SidecarWorld) -> None:
        held = HeldBackups(world)
        prefill, decode = await pair(world)
        tokens = prompt(11)
        # nothing in flight: every reply says no store is writing
        for reply in await replies(world, decode, tokens):
            assert (reply["tokens_total"], reply["store_writing"]) == (0, False), reply
        store = await in_flight(world, prefill, tokens)
        # in flight: said at once, never held (the held copy has not run; no wait began)
        answered = await asyncio.wait_for(replies(world, decode, tokens), timeout=60)
        for reply in answered:
            assert (reply["tokens_total"], reply["store_writing"]) == (0, True), reply
            assert "store_wait" not in reply
        stats = counted(world)
        assert (stats["waits"], stats["waiting"], stats["answered_writing"]) == (0, 0, 4), stats
        assert held.held, "the store was still held when the lookups answered"
        held.release()
        await store
        for reply in await replies(world, decode, tokens):
            assert (reply["tokens_total"], reply["store_writing"]) == (PAGES * PAGE, False)
        assert counted(world)["answered_writing"] == 4

    run(config, body)


def test_a_store_that_fails_ends_store_writing_with_no_hit(config: Path) -> None:  # noqa: F811
    async def body(world: SidecarWorld) -> None:
        held = HeldBackups(world)
        prefill, decode = await pair(world)
        tokens = prompt(12)
        store = await in_flight(world, prefill, tokens)
        assert (await at_once(world, decode, tokens))["store_writing"] is True
        held.release(fail=True)
        assert (await store)["pages_stored"] == 0
        reply = await at_once(world, decode, tokens)
        assert (reply["tokens_total"], reply["store_writing"]) == (0, False)

    run(config, body)


def test_a_partly_held_prompt_says_writing_of_the_page_past_its_hit(config: Path) -> None:  # noqa: F811
    """The prompt's first pages in L2, the rest being written by a longer prompt's store:
    the reply's hit is the first pages, and a store writes the next one."""

    async def body(world: SidecarWorld) -> None:
        held = HeldBackups(world)
        prefill, decode = await pair(world)
        tokens = prompt(13)
        held.backend.submit_walk = held._submit  # type: ignore[method-assign]  # this one lands
        await prefill.store(tokens[: PAGE + 1])
        held.backend.submit_walk = held._held_submit  # type: ignore[method-assign]
        store = asyncio.create_task(prefill.store(tokens))
        await settle(lambda: len(held.held) == 1, "the longer store held")
        for reply in await replies(world, decode, tokens):
            assert (reply["tokens_total"], reply["store_writing"]) == (PAGE, True), reply
        held.release()
        await store
        for reply in await replies(world, decode, tokens):
            assert (reply["tokens_total"], reply["store_writing"]) == (PAGES * PAGE, False)

    run(config, body)


def test_the_drain_says_no_store_is_writing(config: Path) -> None:  # noqa: F811
    """Draining, a lookup is answered with the hit now: nothing tells the engine to ask
    again of a sidecar that is going away."""

    async def body(world: SidecarWorld) -> None:
        held = HeldBackups(world)
        prefill, decode = await pair(world)
        tokens = prompt(14)
        store = await in_flight(world, prefill, tokens)
        world.server.state.store_waits.stop()  # the drain's first step (server.py)
        reply = await at_once(world, decode, tokens)
        assert (reply["tokens_total"], reply["store_writing"]) == (0, False)
        held.release()
        await store

    run(config, body)


def test_answered_at_once_is_still_a_waiting_lookup_for_discovery() -> None:
    """`answer_at_once` changes only whether the reply is held: a consumer's lookup still
    asks L3 again past a remembered "absent" (`Query.trusts_absent`)."""
    at_once_query = Query({}, 0, wait_s=2.0, answer_at_once=True)
    assert (at_once_query.hold_s, at_once_query.trusts_absent) == (0.0, False)
    held_query = Query({}, 0, wait_s=2.0)
    assert (held_query.hold_s, held_query.trusts_absent) == (2.0, False)
    assert Query({}, 0).trusts_absent
