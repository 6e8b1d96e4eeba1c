"""A hypothesis state machine over one `TieredCache`: interleaved lookups, stores, loads,
evictions, cancellations at random await points, L3 faults, slow reads past their timeout,
and concurrent calls on the same prefix — the schedule a busy engine and a flaky L3 make.
Several sessions share it, as engines share a sidecar namespace: the default attachment and
two more (`SESSIONS`), each with device pools of its own, attached and detached at random
(`attach`, `detach`, a detach while one of its ops runs: `detach_mid_op`); an op of a
session not attached is refused by name; one session loads what another stored.

Invariants after every step (once the step's ops and background work have ended):
- every byte a load moved is what was stored for that prefix (token pages, and the state
  snapshot for exactly the hit's length);
- no pin outlives its op; nothing stays pending; the index agrees with every allocator;
- the scheduler holds the device pools of exactly the sessions attached;
- nothing raised but documented errors (cancellation where the rule cancels).

The cache runs on its own event loop in one long-lived task (a TaskGroup must be entered and
left by the same task); each rule hands it a coroutine and waits for the result.
`CacheMachine.run(steps, examples)` drives it from tests/cache/test_stateful.py (short, in CI)
and benchmarks/stateful_soak.py (long).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hicache.assembly import by_key
from hicache.demo.content import check_page, fill_page, prefix_seed
from hicache.memory import DevicePool
from hicache.model import ExplicitLayout, LayerMap
from hicache.scheduler import DEFAULT_ATTACHMENT, OpRequestError
from hicache.storage import FileBackend, GuardedStore
from hicache.testing.faulty_storage import FaultyBackend

PAGE = 4
LAYOUT = ExplicitLayout.model_validate(
    {
        "model_type": "stateful",
        "layers": [
            {"kind": "sliding", "kv_heads": 1, "head_dim": 8, "window_tokens": 8},
            {"kind": "full", "kv_heads": 1, "head_dim": 8},
            {"kind": "linear", "state_shapes": {"conv": [8, 3], "recurrent": [1, 4, 4]}},
        ],
    }
).to_layout("tests/cache/stateful.py")
A = list(range(1, 1 + 6 * PAGE))
C = list(range(500, 500 + 5 * PAGE))
PROMPTS = [
    A,
    A[: 3 * PAGE] + list(range(900, 900 + 3 * PAGE)),  # shares 3 pages of A
    A[: 4 * PAGE + 2],  # off a page boundary
    C,
    A[: 2 * PAGE],
    C[: 3 * PAGE] + list(range(700, 700 + 2 * PAGE)),
]
LANES = 3  # concurrent ops use disjoint device pages: lane k owns pages [16k, 16k + 16)
SESSIONS = (DEFAULT_ATTACHMENT, 1, 2)  # engine sessions of the namespace (attachments)


def lane_pages(lane: int, load: bool, count: int) -> list[int]:
    base = 16 * lane + (8 if load else 0)
    return list(range(base, base + count))


def state_slot(lane: int, load: bool, boundary: int) -> int:
    return 16 * lane + (15 if load else boundary)


class Driver:
    """The cache on its own loop, running inside one task for the machine's life."""

    def __init__(self, root: Path, seed: int):
        self.loop = asyncio.new_event_loop()
        layer_map = LayerMap(LAYOUT)
        self.embedded = by_key.embedded(
            layer_map,
            dtype=torch.float32,
            page_size_tokens=PAGE,
            host_capacity_bytes=1 << 20,  # unused: sized in pages below
            device_pages=16 * LANES,
            host_pages_per_group={"full": 10, "sliding": 8, "linear": 6},
        )
        self.faulty = FaultyBackend(
            FileBackend(root, capacity_bytes=1 << 28), seed=seed, vectored=True
        )
        self.store = GuardedStore(self.faulty, base_timeout_s=0.05)
        self.cache = by_key.tiered(
            self.embedded, store=self.store, prefetch_policy="timeout", write_policy="write_through"
        )
        self._inbox: asyncio.Queue[tuple[Coroutine[Any, Any, Any], asyncio.Future[Any]]]
        self._ready: asyncio.Future[None] = self.loop.create_future()
        self._main = self.loop.create_task(self._serve())
        self.loop.run_until_complete(self._ready)

    async def _serve(self) -> None:
        self._inbox = asyncio.Queue()
        async with self.cache.running():
            self._ready.set_result(None)
            while True:
                coro, result = await self._inbox.get()
                if coro is None:
                    break
                task = asyncio.ensure_future(coro)
                task.add_done_callback(lambda t, r=result: _settle(t, r))

    def call(self, make: Callable[[], Awaitable[Any]]) -> Any:
        async def submit() -> Any:
            result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            await self._inbox.put((make(), result))  # type: ignore[arg-type]
            return await result

        return self.loop.run_until_complete(submit())

    def close(self) -> None:
        async def stop() -> None:
            await self._inbox.put((None, None))  # type: ignore[arg-type]
            await self._main

        try:
            self.loop.run_until_complete(stop())
        finally:
            self.embedded.close()
            self.loop.close()


def _settle(task: asyncio.Task[Any], result: asyncio.Future[Any]) -> None:
    if result.done():
        return
    if task.cancelled():
        result.set_result(None)
    elif task.exception() is not None:
        result.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        result.set_result(task.result())


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self._tmp = tempfile.TemporaryDirectory()
        self.rng = random.Random(0)
        self.driver = Driver(Path(self._tmp.name), seed=0)
        self.cache = self.driver.cache
        self.rules = self.cache.index.rules
        # each session's own device pools; the default one's are the stack's
        self.session_pools = {DEFAULT_ATTACHMENT: self.driver.embedded.device_pools}
        for session in SESSIONS[1:]:
            self.session_pools[session] = {
                name: DevicePool.allocate(geom, 16 * LANES)
                for name, geom in self.driver.embedded.geometries.items()
            }
        self.attached = {DEFAULT_ATTACHMENT}
        self.loads = 0
        self.loaded_tokens = 0

    # ---- the engine's side: what a prefill writes, and the check of a load -------------------

    def _fill(
        self, tokens: list[int], lane: int, session: int
    ) -> tuple[dict[str, list[int]], dict[str, dict[int, int]]]:
        full = len(tokens) // PAGE
        pages, snapshots = {}, {}
        for group, group_rule in self.rules.items():
            pool = self.session_pools[session][group]
            if group_rule.kind.is_token_cache:
                dev = lane_pages(lane, False, full)
                for i, page in enumerate(dev):
                    fill_page(pool, page, prefix_seed(tokens, (i + 1) * PAGE, group))
                pages[group] = dev
            else:
                snaps = {}
                for k in range(full):
                    slot = state_slot(lane, False, k)
                    fill_page(pool, slot, prefix_seed(tokens, (k + 1) * PAGE, group))
                    snaps[(k + 1) * PAGE] = slot
                snapshots[group] = snaps
        return pages, snapshots

    async def _refused_unless_attached(self, session: int, op: Awaitable[int]) -> None:
        """An op of a session not attached: refused by name, or it needed no copy."""
        if session in self.attached:
            await op
            return
        refusal = ""
        try:
            moved = await op
        except OpRequestError as exc:  # the documented refusal, by name
            refusal = str(exc)
        if refusal:
            assert f"attachment {session}: no device pools are attached" in refusal, refusal
        else:  # a store of pages L2 holds already, a load of nothing: no pool touched
            assert moved == 0, f"session {session}, not attached, moved {moved} bytes"

    async def _store(
        self, which: int, lane: int, freed: bool, session: int = DEFAULT_ATTACHMENT
    ) -> int:
        """The bytes it backed up from the session's pools."""
        tokens = PROMPTS[which]
        pages, snapshots = self._fill(tokens, lane, session)
        held: dict[str, list[int | None]] = {g: list(p) for g, p in pages.items()}
        if freed:  # the engine freed the sliding pages its window left
            keep = max(0, (len(tokens) - 8) // PAGE)
            held["sliding"] = [None if i < keep else p for i, p in enumerate(held["sliding"])]
        result = await self.cache.store(tokens, held, snapshots=snapshots, attachment=session)
        return result.bytes_backed_up

    async def _load(self, which: int, lane: int, session: int = DEFAULT_ATTACHMENT) -> int:
        """The tokens it loaded into the session's pools."""
        tokens = PROMPTS[which]
        pools = self.session_pools[session]
        full = len(tokens) // PAGE
        dev = {
            g: lane_pages(lane, True, full)
            if r.kind.is_token_cache
            else [state_slot(lane, True, 0)]
            for g, r in self.rules.items()
        }
        for group in dev:  # NaN-like poison: anything not loaded fails the check
            for page in dev[group]:
                for layer in pools[group].tensors:
                    for t in layer.values():
                        t[page * (PAGE if self.rules[group].kind.is_token_cache else 1)].fill_(-1.0)
        handle, hit = await self.cache.load(tokens, dev, attachment=session)
        if handle is None:
            return 0
        result = await handle.done()
        if not result.ok:
            return 0  # a failed load is reported, never served
        self.loads += 1
        self.loaded_tokens += hit.tokens_total
        for group, rows in hit.needed.items():
            pool = pools[group]
            for i, _ in rows:
                if self.rules[group].kind.is_token_cache:
                    seed = prefix_seed(tokens, (i + 1) * PAGE, group)
                    assert check_page(pool, dev[group][i], seed), (group, i, PROMPTS.index(tokens))
                else:
                    seed = prefix_seed(tokens, hit.tokens_total, group)
                    assert check_page(pool, dev[group][0], seed), (group, hit.tokens_total)
        return int(hit.tokens_total)

    async def _cancelled(self, op: Awaitable[Any], after_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(after_s):
                await op

    # ---- rules ---------------------------------------------------------------------------

    @rule(
        which=st.integers(0, len(PROMPTS) - 1),
        freed=st.booleans(),
        session=st.sampled_from(SESSIONS),
    )
    def store(self, which: int, freed: bool, session: int) -> None:
        self.driver.call(
            lambda: self._refused_unless_attached(session, self._store(which, 0, freed, session))
        )

    @rule(which=st.integers(0, len(PROMPTS) - 1), session=st.sampled_from(SESSIONS))
    def load(self, which: int, session: int) -> None:
        self.driver.call(
            lambda: self._refused_unless_attached(session, self._load(which, 0, session))
        )

    @rule(session=st.sampled_from(SESSIONS[1:]))
    def attach(self, session: int) -> None:
        """An engine session registers its pools (again, once it detached)."""
        if session not in self.attached:
            self.cache.attach_device_pools(self.session_pools[session], attachment=session)
            self.attached.add(session)

    @rule(session=st.sampled_from(SESSIONS[1:]))
    def detach(self, session: int) -> None:
        """A session ends: its ops cancelled and awaited, its pools dropped."""
        self.driver.call(lambda: self.cache.end_attachment(session))
        self.attached.discard(session)

    @rule(
        session=st.sampled_from(SESSIONS[1:]),
        which=st.integers(0, len(PROMPTS) - 1),
        store=st.booleans(),
        other=st.integers(0, len(PROMPTS) - 1),
    )
    def detach_mid_op(self, session: int, which: int, store: bool, other: int) -> None:
        """A session ends while an op of its own runs and another session loads: its op
        is served or cancelled (never wrong bytes, never a pin left); the other's goes on."""
        self.attach(session)

        async def race() -> None:
            own = self._store(which, 1, False, session) if store else self._load(which, 1, session)
            results = await asyncio.gather(
                own,
                self.cache.end_attachment(session),
                self._load(other, 2, DEFAULT_ATTACHMENT),
                return_exceptions=True,
            )
            self.attached.discard(session)
            for result in results[1:]:
                if isinstance(result, BaseException):
                    raise result
            if isinstance(results[0], BaseException) and not isinstance(
                results[0], OpRequestError | asyncio.CancelledError
            ):
                raise results[0]

        self.driver.call(race)

    @rule(which=st.integers(0, len(PROMPTS) - 1))
    def lookup(self, which: int) -> None:
        hit = self.cache.lookup(PROMPTS[which])
        assert hit.tokens_l2 <= hit.tokens_total <= len(PROMPTS[which])

    @rule(
        a=st.integers(0, len(PROMPTS) - 1),
        b=st.integers(0, len(PROMPTS) - 1),
        kinds=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    )
    def concurrent(self, a: int, b: int, kinds: tuple[bool, bool, bool]) -> None:
        """Three ops at once on their own lanes, the same prefix allowed."""

        async def together() -> None:
            ops = []
            for lane, (which, is_store) in enumerate(zip((a, b, a), kinds, strict=True)):
                ops.append(self._store(which, lane, False) if is_store else self._load(which, lane))
            await asyncio.gather(*ops)

        self.driver.call(together)

    @rule(which=st.integers(0, len(PROMPTS) - 1), after_ms=st.integers(0, 6), store=st.booleans())
    def cancel(self, which: int, after_ms: int, store: bool) -> None:
        """The caller gives up at a random await (an `asyncio.timeout` around the call)."""
        op = self._store(which, 1, False) if store else self._load(which, 1)
        self.driver.call(lambda: self._cancelled(op, after_ms / 1000))

    @rule(down=st.booleans())
    def l3_down(self, down: bool) -> None:
        self.driver.faulty.down = down
        if not down:
            self.driver.store.breaker.success()

    @rule(slow=st.booleans(), late=st.booleans())
    def l3_slow(self, slow: bool, late: bool) -> None:
        """Reads slower than their timeout (0.05 s), or not: `slow` on the loop before the
        call (a timeout cancels it), `late` on the backend's thread while it writes the host
        pages (a timeout cannot stop it: the pages must not be reused until it ends)."""
        self.driver.faulty.latency_s = 0.08 if slow else 0.0
        self.driver.faulty.scatter_latency_s = 0.08 if late else 0.0

    @rule(a=st.integers(0, len(PROMPTS) - 1), b=st.integers(0, len(PROMPTS) - 1))
    def late_write_race(self, a: int, b: int) -> None:
        """The schedule that corrupted L2: a load's L3 read times out while its thread still
        writes the reserved pages; a store takes free pages at once; the late write lands;
        the store's prompt is loaded and checked."""

        async def race() -> None:
            faulty = self.driver.faulty
            self.cache.clear_l2()
            faulty.scatter_latency_s = 0.15  # past the 0.05 s timeout, on the thread
            try:
                await self._load(a, 0)
                await asyncio.sleep(0.07)  # the read has timed out; its thread still sleeps
                await self._store(b, 1, False)
            finally:
                faulty.scatter_latency_s = 0.0
            await asyncio.sleep(0.15)  # the late writes land
            await self._load(b, 2)

        self.driver.call(race)

    @rule()
    def clear_l2(self) -> None:
        self.cache.clear_l2()

    @rule()
    def settle(self) -> None:
        self.driver.call(self.cache.drain)

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.driver.call(self.cache.drain)
        self.cache.planner.check()
        for group, pool in self.driver.embedded.host_tier.pools.items():
            stats = pool.allocator.stats()
            assert stats.pinned_pages == 0, group
            assert self.cache.index.pinned_pages(group) == 0, group
            assert not self.cache.planner.pending[group], group
            assert stats.num_pages - stats.free_pages == self.cache.index.l2_pages(group), group
        assert self.cache.background_errors == 0
        assert self.cache.attachments == len(self.attached), (self.attached, self.cache.attachments)

    def teardown(self) -> None:
        self.driver.close()
        self._tmp.cleanup()


def run(steps: int, examples: int, deadline_ms: int | None = None) -> None:
    """Drive the machine: `examples` runs of up to `steps` rules each."""
    machine = CacheMachine.TestCase
    machine.settings = settings(
        max_examples=examples, stateful_step_count=steps, deadline=deadline_ms, derandomize=True
    )
    machine().runTest()
