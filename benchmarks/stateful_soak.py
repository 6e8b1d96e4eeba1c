"""The tier core's state machine run long (tests/cache/stateful.py): random schedules of
lookups, stores, loads, concurrent ops on one prefix, cancellations at random awaits, L3
faults and slow reads, checked after every step. CI runs it short; this runs it long.

    .venv/bin/python benchmarks/stateful_soak.py [--steps 100] [--examples 100]

Last line JSON: {"steps_max", "examples", "loads", "tokens_loaded", "seconds"}. Exits
non-zero (with hypothesis's shrunk failing schedule) on any violated invariant.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cache import stateful


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100, help="rules per schedule, at most")
    parser.add_argument("--examples", type=int, default=100, help="schedules")
    args = parser.parse_args()
    totals = {"loads": 0, "tokens_loaded": 0}
    teardown = stateful.CacheMachine.teardown

    def counting_teardown(self: stateful.CacheMachine) -> None:
        totals["loads"] += self.loads
        totals["tokens_loaded"] += self.loaded_tokens
        teardown(self)

    stateful.CacheMachine.teardown = counting_teardown  # type: ignore[method-assign]
    started = time.perf_counter()
    stateful.run(steps=args.steps, examples=args.examples)
    print(
        json.dumps(
            {
                "steps_max": args.steps,
                "examples": args.examples,
                **totals,
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
