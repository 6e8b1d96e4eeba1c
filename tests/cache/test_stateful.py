"""The tier core's state machine (tests/cache/stateful.py), short enough for CI; the long
run is `benchmarks/stateful_soak.py`."""

from __future__ import annotations

import os

from tests.cache.stateful import run


def test_the_cache_survives_a_random_schedule_of_ops_faults_and_cancellations() -> None:
    run(
        steps=int(os.environ.get("HICACHE_STATEFUL_STEPS", "30")),
        examples=int(os.environ.get("HICACHE_STATEFUL_EXAMPLES", "12")),
    )
