"""Every interleaving of small sidecar scenarios (`hicache.testing.interleave`): the real op
handlers (`PoolOps`, `DataOps`, `EngineServer.end` and `drain`, the namespace registry) for
two or three engine sessions, each scenario run under every order in which its parties can
pass their checkpoints. After each ordering: one namespace per key, every loaded byte what its
token ids give, nothing pinned, reserved or attached that no live session holds, the drain
ends (no namespace task outlives it) and every acknowledged store's pages are in L3
(write-back: they get there by the drain's flush). Each test prints how many orderings it ran.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.testing.interleave import Exploration, Outcome, Run, explore
from hicache.testing.sidecar_world import Engine, EngineError, SidecarWorld
from tests.conftest import shared_model

PAGE = 16


def prompt(i: int, pages: int = 2) -> list[int]:
    return [i * 7919 + t for t in range(pages * PAGE)]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    data = {
        "model": {"config_path": str(shared_model("qwen2_7b.json")), "page_size_tokens": PAGE},
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": "12MiB"},  # 13 pages of 896 KiB
        "storage": {"kind": "file", "path": str(tmp_path / "l3")},
        "cache": {"write_policy": "write_back", "prefetch_policy": "wait_complete"},
        "service": {"socket_path": str(tmp_path / "e.sock"), "drain_timeout_s": 30},
    }
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_all(
    name: str, body: Callable[[SidecarWorld, Run], Awaitable[None]], config: Path
) -> Exploration:
    async def scenario(run: Run) -> None:
        async with SidecarWorld.running(config) as world:
            await body(world, run)
            world.check_settled()
            await world.drain()
            await check_in_l3(world)

    report = explore(scenario, name=name, max_orderings=400)  # prints its summary line
    assert report.exhaustive, report
    return report


async def check_in_l3(world: SidecarWorld) -> None:
    """Every acknowledged store's pages reached L3 (write-back: by the drain's flush)."""
    assert world.report is not None
    assert world.report.pages_unflushed == 0, world.report
    for engine in world.engines:
        if engine.stored:
            missing = await world.l3_missing(engine.key, engine.stored)
            assert missing == 0, f"{engine.name}: {missing} stored pages never reached L3"


def failed(outcome: Outcome) -> str:
    return f"{type(outcome.error).__name__}: {outcome.error}"


async def cross_check(engines: list[Engine]) -> None:
    """Each engine stores its own prompt, then loads every other's: a full hit, exact."""
    for i, engine in enumerate(engines):
        await engine.store(prompt(i))
    for i, engine in enumerate(engines):
        for j, _other in enumerate(engines):
            if i != j:
                tokens = await engine.load(prompt(j), first=4)
                assert tokens == len(prompt(j)), f"{engine.name} hit {tokens} of prompt {j}"


@pytest.mark.parametrize("count", [2, 3])
def test_engines_registering_together_share_one_namespace(config: Path, count: int) -> None:
    async def body(world: SidecarWorld, run: Run) -> None:
        engines = [world.engine(f"e{i}", num_pages=6) for i in range(count)]
        # the registration's awaits: the wait for the key's start, and the start itself
        outcomes = await run.parties(
            {e.name: e.start for e in engines}, at={"attach.start", "namespace.build"}
        )
        for name, outcome in outcomes.items():
            assert outcome.ok, f"{name}: {failed(outcome)}"
        assert len(world.server.namespaces) == 1, list(world.server.namespaces)
        await cross_check(engines)

    run_all(f"register together ({count})", body, config)


def test_a_failed_start_fails_its_waiters_and_a_later_register_starts_afresh(
    config: Path,
) -> None:
    async def body(world: SidecarWorld, run: Run) -> None:
        world.backend.fail_allocs = 1  # the first start's host tier cannot be allocated
        a, b = world.engine("a"), world.engine("b")
        outcomes = await run.parties({"a": a.start, "b": b.start})
        refused = [n for n, o in outcomes.items() if not o.ok]
        assert refused, "one start failed: at least the session that waited for it is refused"
        for name in refused:
            error = outcomes[name].error
            assert isinstance(error, EngineError), failed(outcomes[name])
            assert error.code == "refused", failed(outcomes[name])
            assert "namespace tp_rank=0 tenant='' failed to start: MemoryError: injected" in (
                error.message
            ), error.message
            assert "register_pools again to retry" in error.message
        later = world.engine("later")
        await later.start()  # the key starts afresh
        survivors = [later] + [e for e in (a, b) if outcomes[e.name].ok]
        assert len(world.server.namespaces) == 1
        await cross_check(survivors)
        # the restarted namespace copies (a failed build must not stop the shared backend)
        assert await later.load(prompt(0), first=4) == len(prompt(0)), "later: its own store"

    run_all("failed start with waiters", body, config)


def test_sigterm_during_a_namespace_start_drains_and_ends(config: Path) -> None:
    async def body(world: SidecarWorld, run: Run) -> None:
        a = world.engine("a")

        async def engine() -> None:
            await a.start()
            await a.store(prompt(0))

        async def sigterm() -> None:
            await world.drain()

        outcomes = await run.parties({"a": engine, "drain": sigterm})
        assert outcomes["drain"].ok, failed(outcomes["drain"])
        error = outcomes["a"].error
        if error is not None:  # refused: draining, or its session ended under the store
            assert isinstance(error, EngineError), failed(outcomes["a"])
            assert error.code in {"refused", "not_ready"}, error
            if error.code == "refused":
                assert "the sidecar is draining (shutting down)" in error.message, error
        states = world.server.state.registry.snapshot()
        assert all(s["state"] == "closed" for s in states), states
        assert not world.server.sessions

    async def scenario(run: Run) -> None:
        async with SidecarWorld.running(config) as world:
            await body(world, run)
            await check_in_l3(world)

    report = explore(scenario, name="SIGTERM during a namespace start", max_orderings=400)
    assert report.exhaustive, report


def test_two_engines_storing_one_prefix_together(config: Path) -> None:
    async def body(world: SidecarWorld, run: Run) -> None:
        a, b = world.engine("a"), world.engine("b")
        await a.start()
        await b.start()
        shared = prompt(7, pages=3)
        outcomes = await run.parties(
            {"a": lambda: a.store(shared, first=0), "b": lambda: b.store(shared, first=3)}
        )
        for name, outcome in outcomes.items():
            assert outcome.ok, f"{name}: {failed(outcome)}"
        for engine in (a, b):
            assert await engine.load(shared, first=5 if engine is a else 0) == len(shared)

    run_all("store one prefix together", body, config)


def test_an_engine_killed_mid_op(config: Path) -> None:
    async def body(world: SidecarWorld, run: Run) -> None:
        a, b = world.engine("a"), world.engine("b")
        await a.start()
        await b.start()
        await b.store(prompt(1))

        async def a_works() -> Any:
            await a.store(prompt(0))
            return await a.load(prompt(1), first=4)

        outcomes = await run.parties(
            {"a": a_works, "kill": a.kill, "b": lambda: b.load(prompt(1), first=4)}
        )
        assert outcomes["kill"].ok, failed(outcomes["kill"])
        assert outcomes["b"].ok, failed(outcomes["b"])
        error = outcomes["a"].error  # the dead engine's own ops may fail, never wrongly
        assert error is None or (
            isinstance(error, EngineError) and error.code in {"not_ready", "connection_lost"}
        ), failed(outcomes["a"])
        assert outcomes["b"].value == len(prompt(1))
        assert a.session is not None
        assert a.session.id not in world.server.sessions

    run_all("engine killed mid-op", body, config)


def test_a_session_ending_while_another_attaches(config: Path) -> None:
    async def body(world: SidecarWorld, run: Run) -> None:
        a, b = world.engine("a"), world.engine("b")
        await a.start()
        await a.store(prompt(0))
        outcomes = await run.parties({"end a": a.kill, "b": b.start})
        assert all(o.ok for o in outcomes.values()), outcomes
        assert len(world.server.namespaces) == 1
        assert await b.load(prompt(0), first=4) == len(prompt(0))

    run_all("detach during another's attach", body, config)
