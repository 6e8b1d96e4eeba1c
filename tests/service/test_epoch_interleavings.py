"""Every interleaving of a timeout and reconnect in the middle of a store, and of a load
(`hicache.testing.interleave` over the real op handlers, `SidecarWorld`): the engine's
connection drops while its op is in hand (what its client does when the reply is late), and
the same process registers the same memory again in a new session, then reuses the pages for
another request. After each ordering: the new registration went through only once the old
session had ended (`Session.ended`, and gone from the server's sessions) — or it was refused
`busy` and the engine reused nothing; no page holds another request's bytes (what the old
store filed under its prompt, what the reuse wrote); and the scenario checks of
`test_interleavings.py` (one namespace per key, nothing left pinned, reserved or attached,
the drain ends, acknowledged stores in L3). Each test prints how many orderings it ran.

Defect 2 of issue 32; with the same process exempted from the claim rule
(`claims.holder` skipping this process's sessions, as `ops_pools.py` did at 7767ef8) both
explorations fail (see the report of helper "epoch")."""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.channel.counters import CounterFile
from hicache.demo.content import check_page, fill_page, seeds_for
from hicache.service import checkpoints
from hicache.testing.interleave import Run
from hicache.testing.sidecar_world import Engine, EngineError, SidecarWorld
from tests.service.test_interleavings import config, prompt, run_all  # noqa: F401

FIRST, NEXT = prompt(1), prompt(2)  # the request whose op times out; the one reusing pages


@dataclass
class Reconnect:
    """The same process's next session, registering the old session's memory."""

    old: Engine
    engine: Engine
    outcome: str = ""  # "reused" (registered, pages rewritten) or "refused"
    old_ended_at_reuse: bool = False
    old_live_at_reuse: list[int] = field(default_factory=list)

    async def run(self) -> str:
        await checkpoints.checkpoint("scenario.reconnect")
        self.engine.connect()
        await self.engine.hello()
        assert self.old.pools is not None
        self.engine.counters = CounterFile.create(self.engine.world.server.service.load_slots)
        try:
            await self.engine.call(
                "register_pools",
                **self.old.pools.manifest(),
                counters_fd=self.engine.counters.fd,
            )
        except EngineError as exc:
            if exc.code != "busy":
                raise
            self.outcome = "refused"  # no confirmation: the engine must not reuse a page
            return self.outcome
        # the reuse point: the sidecar has confirmed the old session's end
        old = self.old.session
        assert old is not None
        self.old_ended_at_reuse = old.ended.is_set()
        self.old_live_at_reuse = [s for s in self.engine.world.server.sessions if s == old.id]
        fill(self.old, NEXT)
        self.outcome = "reused"
        return self.outcome


def fill(engine: Engine, tokens: list[int]) -> None:
    """The engine's pages 0.. hold `tokens`' KV (what its forward would write)."""
    assert engine.pools is not None
    device = engine.pools.device_pools()
    for group, ids in engine._pages(tokens, 0).items():
        seeds = seeds_for(tokens, group, True, engine.world.page_size)
        for page, seed in zip(ids, seeds, strict=True):
            fill_page(device[group], page, seed)


def holds(engine: Engine, tokens: list[int]) -> bool:
    assert engine.pools is not None
    device = engine.pools.device_pools()
    for group, ids in engine._pages(tokens, 0).items():
        seeds = seeds_for(tokens, group, True, engine.world.page_size)
        if not all(check_page(device[group], p, s) for p, s in zip(ids, seeds, strict=True)):
            return False
    return True


async def drop(engine: Engine) -> None:
    """The engine's call timed out: it drops the connection (its session ends once the op
    in hand is answered)."""
    await checkpoints.checkpoint("scenario.drop")
    assert engine.link is not None
    engine.link.abort()


def check_reuse(reconnect: Reconnect) -> None:
    if reconnect.outcome == "reused":
        assert reconnect.old_ended_at_reuse, "the memory was handed over before the old end"
        assert not reconnect.old_live_at_reuse, reconnect.old_live_at_reuse


def test_timeout_and_reconnect_in_the_middle_of_a_store(config) -> None:  # noqa: F811
    async def body(world: SidecarWorld, run: Run) -> None:
        old = await world.engine("a").start()
        reader = await world.engine("b").start()
        reconnect = Reconnect(old, world.engine("a-again"))

        async def store() -> None:
            await old.store(FIRST)  # fills pages 0.. with FIRST's KV, then stores them

        outcomes = await run.parties(
            {"store": store, "drop": lambda: drop(old), "reconnect": reconnect.run}
        )
        assert outcomes["reconnect"].ok, outcomes["reconnect"].error
        check_reuse(reconnect)
        if reconnect.outcome == "reused":
            assert holds(old, NEXT)
        # what the old store filed under FIRST is FIRST's KV (WrongBytes otherwise)
        loaded = await reader.load(FIRST, first=2)
        assert loaded in (0, len(FIRST)), loaded

    run_all("timeout and reconnect in the middle of a store", body, config)  # prints its count


def test_timeout_and_reconnect_in_the_middle_of_a_load(config) -> None:  # noqa: F811
    async def body(world: SidecarWorld, run: Run) -> None:
        old = await world.engine("a").start()
        writer = await world.engine("b").start()
        await writer.store(FIRST)  # FIRST is a hit for the old session's load
        reconnect = Reconnect(old, world.engine("a-again"))
        assert old.pools is not None

        async def load() -> None:
            await old.call("load", tokens=FIRST, device_pages=old._pages(FIRST, 0))

        outcomes = await run.parties(
            {"load": load, "drop": lambda: drop(old), "reconnect": reconnect.run}
        )
        assert outcomes["reconnect"].ok, outcomes["reconnect"].error
        check_reuse(reconnect)
        if reconnect.outcome == "reused":  # no late write of the old load over NEXT's KV
            assert holds(old, NEXT), "a load of the old session wrote pages reused since"

    run_all("timeout and reconnect in the middle of a load", body, config)  # prints its count
