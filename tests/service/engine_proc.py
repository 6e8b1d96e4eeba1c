"""A stand-in engine process for the sidecar tests: `python -m tests.service.engine_proc MODE
--config FILE [--prompts N]`. It speaks only through `hicache.client`, computes its "KV" from
token ids (`hicache.demo.content`), and prints one JSON line per event on stdout.

Modes:
  roundtrip    store prompts (ids from --first), wipe the pool, load them into other pages
               with a per-layer consumer, verify every byte; prints {"verified",
               "mismatches", "tokens_loaded"}
  load-loop    store one long prompt, then load it again and again (to be killed mid-load)
  store-loop   store prompt 0, 1, 2, ... printing each acknowledged index (the sidecar is
               SIGTERMed meanwhile)
  verify       load prompts --first.. (N of them) and check every byte loaded; prints the
               counts
  bystander    roundtrips over --prompts prompts until the file --until exists, counting
               (never raising) errors, short loads and wrong bytes; rewrites --status with
               the totals after every round (the hostile-engine tests read it)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

from hicache.channel.shm import SharedPools
from hicache.client import Client, connect_deployment
from hicache.config import load_deployment
from hicache.demo.content import check_page, fill_page, seeds_for
from tests.pages import split_store

PAGE = 16
PROMPT_PAGES = 6


def prompt(i: int) -> list[int]:
    shared = list(range(1000, 1000 + 2 * PAGE))  # a common system prompt
    return shared + [i * 7919 + t for t in range(PROMPT_PAGES * PAGE - len(shared))]


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def pages_for(client: Client, pools: SharedPools, first: int, count: int) -> dict[str, list[int]]:
    out = {}
    for name, geom in client.geometries.items():
        n = count if geom.group.kind.is_token_cache else 1
        out[name] = [(first + k) % pools.num_pages[name] for k in range(n)]
    return out


def prefill(client: Client, pools: SharedPools, tokens: list[int], pages: dict[str, list[int]]):  # type: ignore[no-untyped-def]
    device = pools.device_pools()
    for name, geom in client.geometries.items():
        seeds = seeds_for(tokens, name, geom.group.kind.is_token_cache, PAGE)
        for page, seed in zip(pages[name], seeds, strict=True):
            fill_page(device[name], page, seed)


def store(client: Client, tokens: list[int], pages: dict[str, list[int]]) -> None:
    kinds = {n: g.group.kind for n, g in client.geometries.items()}
    client.store(tokens, *split_store(kinds, tokens, pages, PAGE))


def wipe(pools: SharedPools) -> None:
    pools.buffer.zero_()


def load_and_verify(
    client: Client, pools: SharedPools, tokens: list[int], pages: dict[str, list[int]]
) -> tuple[int, int, int]:
    """Load into `pages`, consuming layer by layer on another thread; returns (pages verified,
    mismatches, tokens loaded)."""
    handle = client.load(tokens, pages)
    if handle is None:
        return 0, 0, 0
    consumer = threading.Thread(
        target=lambda: [handle.wait_layer(i) for i in client.layer_map.stage_layer_ids]
    )
    consumer.start()
    consumer.join()
    state = handle.done()
    if state != "done":
        raise SystemExit(f"load ended {state}")
    device = pools.device_pools()
    verified = mismatches = 0
    loaded_pages = handle.tokens // PAGE
    for name, geom in client.geometries.items():
        token_group = geom.group.kind.is_token_cache
        seeds = seeds_for(tokens[: loaded_pages * PAGE], name, token_group, PAGE)
        positions = client_needed(client, name, loaded_pages)
        for i in positions:
            page = pages[name][i] if token_group else pages[name][0]
            verified += 1
            mismatches += not check_page(device[name], page, seeds[i if token_group else 0])
    return verified, mismatches, handle.tokens


def client_needed(client: Client, group: str, pages: int) -> range:
    from hicache.index import GroupRule

    rule = GroupRule.of(next(g for g in client.layer_map.groups if g.name == group))
    needed: range = rule.needed(pages, PAGE)
    return needed if rule.kind.is_token_cache else range(0, 1)


def bystander(client: Client, pools: SharedPools, args: argparse.Namespace) -> None:
    totals = {"rounds": 0, "verified": 0, "mismatches": 0, "short": 0, "errors": 0}
    first_error = ""
    status = Path(args.status)
    while not Path(args.until).exists():
        tokens = prompt(args.first + totals["rounds"] % args.prompts)
        try:
            src = pages_for(client, pools, 0, PROMPT_PAGES)
            prefill(client, pools, tokens, src)
            store(client, tokens, src)
            wipe(pools)
            verified, mismatches, loaded = load_and_verify(
                client, pools, tokens, pages_for(client, pools, 32, PROMPT_PAGES)
            )
            totals["verified"] += verified
            totals["mismatches"] += mismatches
            totals["short"] += loaded != len(tokens)
        except (Exception, SystemExit) as exc:
            totals["errors"] += 1
            first_error = first_error or f"{type(exc).__name__}: {exc}"
        totals["rounds"] += 1
        partial = status.with_suffix(".tmp")
        partial.write_text(json.dumps({**totals, "first_error": first_error}))
        os.replace(partial, status)
    emit(**totals, first_error=first_error)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "mode", choices=["roundtrip", "load-loop", "store-loop", "verify", "bystander"]
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument(
        "--first", type=int, default=0, help="the first prompt id (roundtrip, verify, bystander)"
    )
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--tenant", default="")
    parser.add_argument("--until", help="bystander: stop once this file exists")
    parser.add_argument("--status", help="bystander: the totals, rewritten every round")
    args = parser.parse_args()
    loaded = load_deployment(args.config)
    client = connect_deployment(
        loaded,
        tp_rank=args.tp_rank,
        tenant=args.tenant,
        engine=f"test-{args.mode}",
    )
    pools = client.create_pools(64)
    client.register_pools(pools)
    emit(event="registered", session=client.session["session"])
    try:
        if args.mode == "roundtrip":
            total = [0, 0, 0]
            for i in range(args.first, args.first + args.prompts):
                tokens = prompt(i)
                src = pages_for(client, pools, 0, PROMPT_PAGES)
                prefill(client, pools, tokens, src)
                store(client, tokens, src)
                wipe(pools)
                got = load_and_verify(client, pools, tokens, pages_for(client, pools, 32, 6))
                total = [a + b for a, b in zip(total, got, strict=True)]
            emit(verified=total[0], mismatches=total[1], tokens_loaded=total[2])
        elif args.mode == "load-loop":
            tokens = prompt(0)
            src = pages_for(client, pools, 0, PROMPT_PAGES)
            prefill(client, pools, tokens, src)
            store(client, tokens, src)
            emit(event="looping")
            while True:
                handle = client.load(tokens, pages_for(client, pools, 32, PROMPT_PAGES))
                assert handle is not None
                handle.done()
        elif args.mode == "store-loop":
            for i in range(args.prompts):
                tokens = prompt(i)
                src = pages_for(client, pools, (i * PROMPT_PAGES) % 48, PROMPT_PAGES)
                prefill(client, pools, tokens, src)
                store(client, tokens, src)
                emit(stored=i)
        elif args.mode == "bystander":
            bystander(client, pools, args)
        else:
            verified = mismatches = hits = 0
            for i in range(args.first, args.first + args.prompts):
                got = load_and_verify(client, pools, prompt(i), pages_for(client, pools, 0, 6))
                verified += got[0]
                mismatches += got[1]
                hits += got[2] > 0
            emit(verified=verified, mismatches=mismatches, prompts_hit=hits)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
