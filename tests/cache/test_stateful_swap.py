"""The tier core's state machine (`stateful.py`) with one more rule: L3 detached and
attached again (a fresh store over the same backend, as the admin API builds one) while
loads and stores are in flight. The machine's own invariants judge every step: loaded bytes
exact, no pin or pending key left, index and allocators agreeing, no background error."""

from __future__ import annotations

import asyncio
import os

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from hicache.storage import GuardedStore
from tests.cache.stateful import PROMPTS, CacheMachine


class SwapMachine(CacheMachine):
    @rule(
        a=st.integers(0, len(PROMPTS) - 1),
        b=st.integers(0, len(PROMPTS) - 1),
        pause_ms=st.integers(0, 3),
        swaps=st.integers(1, 4),
    )
    def swap_l3_mid_flight(self, a: int, b: int, pause_ms: int, swaps: int) -> None:
        async def together() -> None:
            ops = [
                asyncio.ensure_future(op)
                for op in (self._load(a, 0), self._store(b, 1, False), self._load(b, 2))
            ]
            for _ in range(swaps):
                await asyncio.sleep(pause_ms / 1000)
                self.cache.attach_l3(None)
                await asyncio.sleep(0)
                self.driver.store = GuardedStore(self.driver.faulty, base_timeout_s=0.05)
                self.cache.attach_l3(self.driver.store)
            await asyncio.gather(*ops)  # none of them may raise

        self.driver.call(together)


def test_the_cache_survives_l3_swaps_amid_a_random_schedule() -> None:
    machine = SwapMachine.TestCase
    machine.settings = settings(
        max_examples=int(os.environ.get("HICACHE_STATEFUL_EXAMPLES", "8")),
        stateful_step_count=int(os.environ.get("HICACHE_STATEFUL_STEPS", "25")),
        deadline=None,
        derandomize=True,
    )
    machine().runTest()
