"""A lookup that waits for pages a store in flight is writing (`service/store_waits.py`), against
the real engine server in this process (`SidecarWorld`: the real op handlers, namespaces,
tiered cache and scheduler), one engine storing a prompt (the prefill instance) and another
looking it up with `wait_stored_s` (the decode instance). The test holds the store's backup
walk (the copy backend's walk is queued until released), so "in flight" is a state the test
sets, not a race: every ordering of the wait's lifecycle — the store lands before the
lookup, during the wait, never (the bound passes), fails (the plan aborted), its engine dies
mid-store, the sidecar drains during the wait — each with its outcome counted in
`/v1/stats`'s `store_waits`. And a store asked to answer once L3 holds its pages
(`persisted_within_s`, a producer whose decode instance is on another host).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.service.store_waits import OUTCOMES
from hicache.testing.sidecar_world import Engine, SidecarWorld
from hicache.transfer.backend import CancelToken, Direction, Fence, LayerPart
from hicache.transfer.cpu_backend import WalkProgress
from tests.conftest import shared_model

PAGE = 16
PAGES = 3


def prompt(i: int) -> list[int]:
    return [i * 7919 + t for t in range(PAGES * PAGE + 5)]


def write_config(
    tmp_path: Path, name: str, host_bytes: str = "12MiB", **sections: dict[str, Any]
) -> Path:
    """The tests' deployment (Qwen2-7B, CPU pools, the world's L3), with `sections` added."""
    data = {
        "model": {"config_path": str(shared_model("qwen2_7b.json")), "page_size_tokens": PAGE},
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": host_bytes},
        "storage": {"kind": "none"},
        "service": {"socket_path": str(tmp_path / "e.sock"), "drain_timeout_s": 30},
        **sections,
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return write_config(tmp_path, "deploy.yaml")


class HeldBackups:
    """The world's copy backend with its backup walks held until `release` (the copies of a
    store in flight); loads run as they come."""

    def __init__(self, world: SidecarWorld):
        self.backend = world.backend
        self.held: list[tuple[Any, ...]] = []
        self._submit = self.backend.submit_walk
        self.backend.submit_walk = self._held_submit  # type: ignore[method-assign]
        _HELD[id(world)] = self  # released when the test ends, failed or not (`run`)

    def _held_submit(
        self,
        direction: Direction,
        layers: Sequence[Sequence[LayerPart]],
        done: Callable[[dict[int, BaseException]], None],
        after: Fence | None = None,
        cancel: CancelToken | None = None,
        on_layer: Callable[[int, Any], None] | None = None,
    ) -> WalkProgress:
        if direction is not Direction.BACKUP:
            return self._submit(direction, layers, done, after, cancel, on_layer)
        progress = WalkProgress()
        self.held.append((direction, layers, done, cancel, progress, on_layer))
        return progress

    def release(self, *, fail: bool = False) -> int:
        """Run (or fail at its first layer) every held walk; how many."""
        held, self.held = self.held, []
        for direction, layers, done, cancel, progress, on_layer in held:
            if fail:
                done({0: RuntimeError("injected: the backup walk failed")})
            else:
                self.backend._walk(direction, layers, done, cancel, progress, on_layer)
        return len(held)


async def settle(condition: Callable[[], bool], what: str) -> None:
    """Let the loop run until `condition` holds (the world's copies are loop callbacks: no
    thread, so a bounded number of loop turns decides it)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never: {what}")


async def settled(world: SidecarWorld) -> None:
    """`check_settled` once the loop has run the ops' ends (a load's pins go a few loop
    turns after its handle is done)."""

    def ok() -> bool:
        try:
            world.check_settled()
        except AssertionError:
            return False
        return True

    await settle(ok, "nothing pinned, reserved or attached that no live session holds")
    world.check_settled()


def key_args(world: SidecarWorld, engine: Engine, tokens: list[int]) -> dict[str, bytes]:
    namespace = world.server.namespaces[engine.key]
    return {g: b"".join(k.keys(tokens)) for g, k in namespace.cache.index.keyers.items()}


async def lookup(
    world: SidecarWorld, engine: Engine, tokens: list[int], wait_s: float
) -> dict[str, Any]:
    return await engine.call(
        "lookup_keys",
        keys=key_args(world, engine, tokens),
        num_tokens=len(tokens),
        wait_stored_s=wait_s,
    )


def writing(world: SidecarWorld, engine: Engine) -> int:
    namespace = world.server.namespaces[engine.key]
    return sum(len(keys) for keys in namespace.cache.planner.pending.values())


def counted(world: SidecarWorld) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(world.server.state.store_waits.stats)


async def pair(world: SidecarWorld) -> tuple[Engine, Engine]:
    prefill = await world.engine("prefill").start()
    decode = await world.engine("decode", num_pages=8).start()
    return prefill, decode


async def in_flight(world: SidecarWorld, prefill: Engine, tokens: list[int]) -> asyncio.Task[Any]:
    """The prefill's store, started and held mid-copy (its pages pending)."""
    store = asyncio.create_task(prefill.store(tokens))
    await settle(lambda: writing(world, prefill) == PAGES, "the store's pages pending")
    return store


_HELD: dict[int, HeldBackups] = {}


def run(config: Path, body: Callable[[SidecarWorld], Any]) -> None:
    """`body` against a fresh world; walks it left held are released at its end, so a
    failing test fails (the drain would otherwise wait for them for good)."""

    async def main() -> None:
        async with SidecarWorld.running(config) as world:
            try:
                await body(world)
            finally:
                held = _HELD.pop(id(world), None)
                if held is not None:
                    held.release()

    asyncio.run(main())


def test_store_landed_before_the_lookup_is_no_wait(config: Path) -> None:
    async def body(world: SidecarWorld) -> None:
        prefill, decode = await pair(world)
        tokens = prompt(1)
        await prefill.store(tokens)
        reply = await lookup(world, decode, tokens, 30.0)
        assert reply["tokens_total"] == PAGES * PAGE
        assert "store_wait" not in reply
        assert counted(world)["waits"] == 0
        assert await decode.load(tokens) == PAGES * PAGE

    run(config, body)


def test_store_landing_during_the_wait_is_a_hit(config: Path) -> None:
    async def body(world: SidecarWorld) -> None:
        held = HeldBackups(world)
        prefill, decode = await pair(world)
        tokens = prompt(2)
        store = await in_flight(world, prefill, tokens)
        # without a wait: answered now, the pages not there yet
        assert (await lookup(world, decode, tokens, 0.0))["tokens_total"] == 0
        waiting = asyncio.create_task(lookup(world, decode, tokens, 30.0))
        await settle(lambda: counted(world)["waiting"] == 1, "the lookup waiting")
        assert not waiting.done()
        assert held.release() == 1
        reply = await waiting
        assert reply["tokens_total"] == PAGES * PAGE
        assert reply["store_wait"] == "hit"
        await store
        stats = counted(world)
        assert (stats["waits"], stats["hit"], stats["waiting"]) == (1, 1, 0), stats
        assert await decode.load(tokens) == PAGES * PAGE  # byte-exact (checked by `load`)
        await settled(world)

    run(config, body)


def test_store_outlasting_the_bound_times_out(config: Path) -> None:
    async def body(world: SidecarWorld) -> None:
        held = HeldBackups(world)
        prefill, decode = await pair(world)
        tokens = prompt(3)
        store = await in_flight(world, prefill, tokens)
        reply = await lookup(world, decode, tokens, 0.05)  # the held copy never lands by then
        assert reply["tokens_total"] == 0
        assert reply["store_wait"] == "timed_out"
        held.release()
        await store
        stats = counted(world)
        assert (stats["waits"], stats["timed_out"], stats["hit"]) == (1, 1, 0), stats
        # the pages are in L2 now: the next lookup hits without waiting
        reply = await lookup(world, decode, tokens, 30.0)
        assert (reply["tokens_total"], "store_wait" in reply) == (PAGES * PAGE, False)
        await settled(world)

    run(config, body)


def test_store_that_fails_ends_the_wait_as_a_miss(config: Path) -> None:
    async def body(world: SidecarWorld) -> None:
        held = HeldBackups(world)
        prefill, decode = await pair(world)
        tokens = prompt(4)
        store = asyncio.create_task(prefill.store(tokens))
        await settle(lambda: writing(world, prefill) == PAGES, "the store's pages pending")
        waiting = asyncio.create_task(lookup(world, decode, tokens, 30.0))
        await settle(lambda: counted(world)["waiting"] == 1, "the lookup waiting")
        held.release(fail=True)
        reply = await waiting
        assert (reply["tokens_total"], reply["store_wait"]) == (0, "missed")
        stored = await store
        assert stored["pages_stored"] == 0  # the failed copy stored nothing
        # and says so: L2 holds none of the prompt (not "all of it, already there")
        assert stored["truncated_to_tokens"] == 0
        assert counted(world)["missed"] == 1
        assert writing(world, prefill) == 0
        await settled(world)

    run(config, body)


def test_producer_dying_mid_store_the_copy_still_lands(config: Path) -> None:
    """The prefill engine's connection drops while its store is held mid-copy: the sidecar's
    copy reads memory it mapped, so the store lands (or fails) on its own; the waiting
    lookup answers once it ended, the dead engine's session ends after it."""

    async def body(world: SidecarWorld) -> None:
        held = HeldBackups(world)
        prefill, decode = await pair(world)
        tokens = prompt(5)
        store = await in_flight(world, prefill, tokens)
        waiting = asyncio.create_task(lookup(world, decode, tokens, 30.0))
        await settle(lambda: counted(world)["waiting"] == 1, "the lookup waiting")
        assert prefill.link is not None
        prefill.link.abort()  # the engine dies; its session ends once its op in hand ended
        await settle(
            lambda: prefill.session is not None and prefill.session.ending is not None,
            "the session ending",
        )
        assert not waiting.done()
        held.release()
        reply = await waiting
        assert (reply["tokens_total"], reply["store_wait"]) == (PAGES * PAGE, "hit")
        await asyncio.gather(store, return_exceptions=True)
        assert prefill.session is not None
        assert prefill.session.ending is not None
        await prefill.session.ending
        assert await decode.load(tokens) == PAGES * PAGE
        await settled(world)

    run(config, body)


def test_drain_during_the_wait_answers_at_once(config: Path) -> None:
    async def body(world: SidecarWorld) -> None:
        held = HeldBackups(world)
        prefill, decode = await pair(world)
        tokens = prompt(6)
        store = await in_flight(world, prefill, tokens)
        waiting = asyncio.create_task(lookup(world, decode, tokens, 30.0))
        await settle(lambda: counted(world)["waiting"] == 1, "the lookup waiting")
        drain = asyncio.create_task(world.drain())
        reply = await waiting  # before the held store lands: the drain ended the wait
        assert (reply["tokens_total"], reply["store_wait"]) == (0, "drained")
        assert held.held, "the store was still held when the lookup answered"
        held.release()
        await asyncio.gather(store, return_exceptions=True)
        await drain
        stats = counted(world)
        assert (stats["waits"], stats["drained"], stats["waiting"]) == (1, 1, 0), stats

    run(config, body)


def test_outcomes_are_the_stats_keys() -> None:
    from hicache.service.store_waits import StoreWaitStats

    assert set(OUTCOMES) <= set(StoreWaitStats.__dataclass_fields__)


def test_wait_bound_refused_past_the_protocol_limit() -> None:
    from pydantic import ValidationError

    from hicache.channel import protocol as p

    with pytest.raises(ValidationError, match="wait_stored_s"):
        p.KeyLookup.model_validate({"keys": {}, "wait_stored_s": p.MAX_STORE_WAIT_S + 1})
    with pytest.raises(ValidationError, match="wait_stored_s"):
        p.KeyLookup.model_validate({"keys": {}, "wait_stored_s": -1.0})
    keyed = {"keys": {}, "device_pages": {}}
    for field in ("persisted_within_s", "l3_wait_s"):  # a keyed store's and load's waits
        with pytest.raises(ValidationError, match=field):
            (p.KeyedStore if field.startswith("persisted") else p.KeyedLoad).model_validate(
                keyed | {field: p.MAX_STORE_WAIT_S + 1}
            )
    assert p.KeyedLoad.model_validate(keyed).l3_wait_s is None  # the prefetch policy's


def test_a_store_asked_to_persist_answers_once_l3_holds_its_pages(config: Path) -> None:
    """`persisted_within_s`: the producer for a decode host that reads L3. The reply comes
    once L3 holds every page (write-through: written behind the L2 acknowledgement)."""

    async def body(world: SidecarWorld) -> None:
        prefill = await world.engine("prefill").start()
        tokens = prompt(7)
        reply = await prefill.call(
            "store",
            tokens=tokens,
            device_pages=prefill._pages(tokens, 0),
            persisted_within_s=30.0,
        )
        assert (reply["pages_stored"], reply["persisted"]) == (PAGES, True)
        assert await world.l3_missing(prefill.key, [tokens]) == 0
        # without it: no `persisted` in the reply (an older client's store, unchanged)
        plain = await prefill.call(
            "store", tokens=prompt(8), device_pages=prefill._pages(prompt(8), 3)
        )
        assert "persisted" not in plain

    run(config, body)


def test_a_keyed_store_asked_to_persist_waits_for_the_pages_it_stored(tmp_path: Path) -> None:
    """`store_keys` with `persisted_within_s` (SGLang's MLA writer, rank 0, whose other ranks
    read its latents from L3): answered once L3 holds the pages it stored. An L2 of 3 pages
    holds 3 of a 5-page prompt (`truncated_to_tokens`): the wait is for those 3, and True."""
    path = write_config(tmp_path, "small_l2.yaml", host_bytes="3MiB")  # 3 pages of 0.875 MiB

    async def body(world: SidecarWorld) -> None:
        writer = await world.engine("rank0").start()
        tokens = [11 * 7919 + t for t in range(5 * PAGE)]
        reply = await writer.call(
            "store_keys",
            keys=key_args(world, writer, tokens),
            device_pages={g: [0, 1, 2, 3, 4] for g in writer._pages(tokens, 0)},
            persisted_within_s=30.0,
        )
        assert (reply["pages_stored"], reply["truncated_to_tokens"]) == (3, 3 * PAGE)
        assert reply["persisted"] is True
        assert await world.l3_missing(writer.key, [tokens[: 3 * PAGE]]) == 0
        plain = await writer.call(
            "store_keys",
            keys=key_args(world, writer, tokens[:PAGE]),
            device_pages={g: [0] for g in writer._pages(tokens, 0)},
        )
        assert "persisted" not in plain  # not asked: answered at L2, as before

    run(path, body)


def test_a_store_whose_pages_are_not_owed_to_l3_answers_not_persisted(tmp_path: Path) -> None:
    """write_back offers nothing to L3 at a store: nothing is owed, so the reply says so at
    once rather than waiting out the bound."""
    path = write_config(tmp_path, "write_back.yaml", cache={"write_policy": "write_back"})

    async def body(world: SidecarWorld) -> None:
        prefill = await world.engine("prefill").start()
        tokens = prompt(9)
        reply = await asyncio.wait_for(
            prefill.call(
                "store",
                tokens=tokens,
                device_pages=prefill._pages(tokens, 0),
                persisted_within_s=60.0,
            ),
            timeout=30,  # a hang bound only: the answer comes without waiting for L3
        )
        assert (reply["pages_stored"], reply["persisted"]) == (PAGES, False)

    run(path, body)


def test_each_wait_is_counted_in_the_metrics_by_outcome(config: Path) -> None:
    async def body(world: SidecarWorld) -> None:
        held = HeldBackups(world)
        prefill, decode = await pair(world)
        tokens = prompt(10)
        store = await in_flight(world, prefill, tokens)
        assert (await lookup(world, decode, tokens, 0.01))["store_wait"] == "timed_out"
        waiting = asyncio.create_task(lookup(world, decode, tokens, 30.0))
        await settle(lambda: counted(world)["waiting"] == 1, "the lookup waiting")
        held.release()
        assert (await waiting)["store_wait"] == "hit"
        await store
        registry = world.server.state.metrics.registry
        counts = {
            o: registry.get_sample_value("hicache_lookup_store_waits_total", {"outcome": o})
            for o in OUTCOMES
        }
        assert counts == {
            "hit": 1,
            "missed": None,
            "timed_out": 1,
            "drained": None,
            "abandoned": None,
        }

    run(config, body)
