"""A long-lived stand-in engine of one tenant for the noisy-tenant test, driven over stdin:
`python -m tests.service.tenant_engine --config FILE --tenant T --first N --prompts K`.
It speaks only through `hicache.client`; its "KV" is computed from token ids
(`hicache.demo.content`), so every loaded byte is checked. One JSON line answers each command:

  replay      its working set (prompts N..N+K-1): each one looked up in L2 and loaded (every
              byte verified), or, on a miss, prefilled and stored again, as an engine would;
              answers {"asked", "hit", "mismatches"} in tokens and pages
  flood M     stores M cold prompts, never seen before; answers {"stored"}
  quit        closes the client and exits 0
"""

from __future__ import annotations

import argparse
import json
import sys

from hicache.client import connect_deployment
from hicache.config import load_deployment
from tests.service.engine_proc import PAGE, load_and_verify, pages_for, prefill, store, wipe

PROMPT_PAGES = 4


def prompt(tenant_seed: int, i: int) -> list[int]:
    base = 100_000 + tenant_seed * 10_000_000 + i * PROMPT_PAGES * PAGE
    return list(range(base, base + PROMPT_PAGES * PAGE))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--seed", type=int, required=True, help="keeps tenants' prompts apart")
    parser.add_argument("--prompts", type=int, default=4, help="the working set")
    args = parser.parse_args()
    client = connect_deployment(
        load_deployment(args.config), tenant=args.tenant, engine=f"tenant-{args.tenant}"
    )
    pools = client.create_pools(64)
    client.register_pools(pools)
    cold = args.prompts  # the next prompt id no one has used
    print(json.dumps({"event": "registered"}), flush=True)
    try:
        for line in sys.stdin:
            command = line.split()
            if command[0] == "replay":
                asked = hit = mismatches = 0
                for i in range(args.prompts):
                    tokens = prompt(args.seed, i)
                    asked += len(tokens)
                    if client.lookup(tokens).tokens_l2 == len(tokens):
                        wipe(pools)
                        _, bad, loaded = load_and_verify(
                            client, pools, tokens, pages_for(client, pools, 32, PROMPT_PAGES)
                        )
                        hit, mismatches = hit + loaded, mismatches + bad
                        continue
                    src = pages_for(client, pools, 0, PROMPT_PAGES)
                    prefill(client, pools, tokens, src)
                    store(client, tokens, src)
                print(
                    json.dumps({"asked": asked, "hit": hit, "mismatches": mismatches}), flush=True
                )
            elif command[0] == "flood":
                for _ in range(int(command[1])):
                    tokens = prompt(args.seed, cold)
                    cold += 1
                    src = pages_for(client, pools, 0, PROMPT_PAGES)
                    prefill(client, pools, tokens, src)
                    store(client, tokens, src)
                print(json.dumps({"stored": int(command[1])}), flush=True)
            else:
                break
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
