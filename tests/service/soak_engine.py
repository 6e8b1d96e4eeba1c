"""A soak engine process: `python -m tests.service.soak_engine --config FILE --seconds S
--seed N --until PATH`. One engine session of the default namespace that, for S seconds,
stores and loads prompts drawn (by its seed) from a small set every soak engine shares —
one system prompt, a few tails — so several engines store and load the same pages at once.
Every store fills its source pages with the bytes its tokens determine
(`hicache.demo.content`); every load goes into wiped pages, consumed layer by layer, and
every page it loaded is checked. Then it prints its totals as one JSON line, keeps its
session open until the file --until exists (the test reads the sidecar's stats meanwhile),
and closes.

Totals: stores, loads, hits (loads that loaded anything), foreign_hits (hits on a prompt
this engine never stored: another engine's pages), tokens_loaded, verified (pages
checked), mismatches, short (a hit shorter than the prompt), busy (the sidecar's transient
"busy": every L2 page pinned by copies in flight), errors and the first error's text.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from hicache.client import ClientError, connect_deployment
from hicache.config import load_deployment
from tests.service.engine_proc import (
    PROMPT_PAGES,
    emit,
    load_and_verify,
    pages_for,
    prefill,
    prompt,
    store,
    wipe,
)

PROMPTS = 6  # prompt ids 0..5: every soak engine draws from the same ones
UNTIL_TIMEOUT_S = 600.0  # never outlive a test that forgot to say stop


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--until", required=True)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    client = connect_deployment(
        load_deployment(args.config), engine=f"test-soak-{args.seed}", tenant=""
    )
    pools = client.create_pools(64)
    client.register_pools(pools)
    emit(event="registered", session=client.session["session"])
    totals = dict.fromkeys(
        (
            "stores",
            "loads",
            "hits",
            "foreign_hits",
            "tokens_loaded",
            "verified",
            "mismatches",
            "short",
            "busy",
        ),
        0,
    )
    mine: set[int] = set()  # the prompts this engine stored: a hit on another is another's
    totals["errors"] = 0
    first_error = ""
    src = pages_for(client, pools, 0, PROMPT_PAGES)
    dst = pages_for(client, pools, 32, PROMPT_PAGES)
    try:
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            which = rng.randrange(PROMPTS)
            tokens = prompt(which)
            try:
                if rng.random() < 0.4:
                    prefill(client, pools, tokens, src)
                    store(client, tokens, src)
                    totals["stores"] += 1
                    mine.add(which)
                else:
                    wipe(pools)  # nothing left from an earlier load can pass the check
                    verified, mismatches, loaded = load_and_verify(client, pools, tokens, dst)
                    totals["loads"] += 1
                    totals["hits"] += loaded > 0
                    totals["foreign_hits"] += loaded > 0 and which not in mine
                    totals["tokens_loaded"] += loaded
                    totals["verified"] += verified
                    totals["mismatches"] += mismatches
                    totals["short"] += 0 < loaded < len(tokens)
            except ClientError as exc:
                if exc.code == "busy":
                    totals["busy"] += 1
                    continue
                totals["errors"] += 1
                first_error = first_error or str(exc)
            except (Exception, SystemExit) as exc:
                totals["errors"] += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"
        emit(**totals, first_error=first_error)
        deadline = time.monotonic() + UNTIL_TIMEOUT_S
        while not Path(args.until).exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the client's heartbeat thread keeps the session alive
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
