"""An engine process the register-together judge (`test_register_together.py`) steps through
rounds: `python -m tests.service.barrier_engine --config FILE --index I --engines N`. It
reads one command per line on stdin and answers each with one JSON line on stdout, so the
test holds every engine at the same step (a barrier) and releases them all at once:

  connect R   close the previous session; connect and say hello in namespace tenant
              `round-R` -> {"event": "connected", "session": id}
  register    register pools of its own (new memfds: a session's close closes them)
              -> {"event": "registered"}
  store       store its own prompt of round R (ids `R * N + I`: no other engine stores its
              tail) -> {"event": "stored"}
  load        load the next engine's prompt of round R (engine I + 1 mod N stored it) into
              wiped pages, every loaded byte checked -> {"event": "loaded", "hits", "short",
              "verified", "mismatches"}
  verify R..  (a fresh sidecar, empty L2) for each round given: connect, register, load
              every engine's prompt of that round (from L3) and check it -> {"event":
              "verified", "full", "short", "verified", "mismatches"}
  quit        close and exit 0

Any failure is one JSON line {"event": "error", "error": ...}; the test fails on it.
"""

from __future__ import annotations

import argparse
import sys

from hicache.client import Client, connect_deployment
from hicache.config import load_deployment
from tests.service.engine_proc import PAGE, emit, load_and_verify, pages_for, prefill, store, wipe

PROMPT_PAGES = 3


def prompt(i: int) -> list[int]:
    shared = list(range(1000, 1000 + PAGE))  # a system prompt every engine's prompt starts with
    return shared + [i * 7919 + t for t in range((PROMPT_PAGES - 1) * PAGE)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--engines", type=int, required=True)
    args = parser.parse_args()
    loaded = load_deployment(args.config)
    client: Client | None = None
    pools = None
    round_ = 0

    def connect(tenant: str) -> Client:
        return connect_deployment(loaded, engine=f"test-barrier-{args.index}", tenant=tenant)

    for line in sys.stdin:
        command, *rest = line.split()
        try:
            if command == "quit":
                break
            if command == "connect":
                if client is not None:
                    client.close()
                round_ = int(rest[0])
                client = connect(f"round-{round_}")
                emit(event="connected", session=client.session["session"])
            elif command == "register":
                assert client is not None
                pools = client.create_pools(16)  # a session's close closes its pools' memfd
                client.register_pools(pools)
                emit(event="registered")
            elif command == "store":
                assert client is not None
                assert pools is not None
                tokens = prompt(round_ * args.engines + args.index)
                src = pages_for(client, pools, 0, PROMPT_PAGES)
                prefill(client, pools, tokens, src)
                store(client, tokens, src)
                emit(event="stored")
            elif command == "load":
                assert client is not None
                assert pools is not None
                totals = dict.fromkeys(("hits", "short", "verified", "mismatches"), 0)
                for other in [(args.index + 1) % args.engines]:
                    tokens = prompt(round_ * args.engines + other)
                    wipe(pools)
                    dst = pages_for(client, pools, 8, PROMPT_PAGES)
                    verified, mismatches, got = load_and_verify(client, pools, tokens, dst)
                    totals["hits"] += got > 0
                    totals["short"] += got < len(tokens)
                    totals["verified"] += verified
                    totals["mismatches"] += mismatches
                emit(event="loaded", **totals)
            elif command == "verify":
                totals = dict.fromkeys(("full", "short", "verified", "mismatches"), 0)
                for r in map(int, rest):
                    if client is not None:
                        client.close()
                    client = connect(f"round-{r}")
                    pools = client.create_pools(16)
                    client.register_pools(pools)
                    for index in range(args.engines):
                        tokens = prompt(r * args.engines + index)
                        wipe(pools)
                        dst = pages_for(client, pools, 8, PROMPT_PAGES)
                        verified, mismatches, got = load_and_verify(client, pools, tokens, dst)
                        totals["full"] += got == len(tokens)
                        totals["short"] += got < len(tokens)
                        totals["verified"] += verified
                        totals["mismatches"] += mismatches
                emit(event="verified", **totals)
            else:
                emit(event="error", error=f"unknown command {command!r}")
        except (Exception, SystemExit) as exc:
            emit(event="error", error=f"{command}: {type(exc).__name__}: {exc}")
    if client is not None:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
