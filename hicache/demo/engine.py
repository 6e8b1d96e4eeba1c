"""The demo's synthetic engine: a separate process that behaves like an inference engine
attached to the sidecar, with a real model's layer pattern and its own device pool (L1).

Per request of the trace:
  1. L1: the longest finished sequence still resident in its pool that prefixes the prompt.
  2. lookup at the sidecar (L2 + L3, hybrid-aware); the better of the two is used.
  3. load what the sidecar hits into fresh pages, layer by layer, while a simulated forward
     computes the new tokens layer by layer (each layer waits on `wait_layer` first; the time
     blocked there is the per-layer stall); every loaded page is checked byte for byte.
  4. "prefill" the rest: pages written from the token ids (`content`), at a simulated cost.
  5. store the prompt's pages at the sidecar; the sequence stays resident in L1 until the
     pool needs room (least recently used sequences are evicted first).

It prints one JSON line per request (`{"event": "request", ...}`) and a final
`{"event": "summary", ...}`; `hicache demo` renders them.
    python -m hicache.demo.engine --config FILE --socket PATH [trace options]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hicache.channel.shm import SharedPools
from hicache.client import Client, LoadHandle, connect_deployment
from hicache.config import load_deployment
from hicache.demo.content import check_page, fill_page, seeds_for
from hicache.demo.trace import TraceOptions, build_trace
from hicache.index import GroupRule
from hicache.memory import DevicePool


def _page_equal(a: Sequence[int], b: Sequence[int], k: int, page: int) -> bool:
    return tuple(a[k * page : (k + 1) * page]) == tuple(b[k * page : (k + 1) * page])


@dataclass
class Resident:
    """A finished sequence whose pages are still in the device pool (L1)."""

    tokens: tuple[int, ...]  # page-aligned
    pages: dict[str, list[int]]
    last_used: int


@dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    tokens_l1: int = 0
    tokens_l2: int = 0
    tokens_l3: int = 0
    tokens_computed: int = 0
    loads: int = 0
    # pages of a load's hit L2 lacked at its prefetch deadline: late (the fetch goes on in the
    # background, the engine recomputes them meanwhile) or gone from L3
    load_failed_pages: int = 0
    bytes_loaded: int = 0
    pages_verified: int = 0
    bytes_verified: int = 0
    mismatches: int = 0
    stall_s: list[float] = field(default_factory=list)  # per waited layer
    compute_s: float = 0.0
    wall_s: float = 0.0
    l1_evictions: int = 0


class SyntheticEngine:
    def __init__(
        self,
        client: Client,
        pools: SharedPools,
        page_size_tokens: int,
        prefill_tokens_per_s: float,
    ):
        self.client = client
        self.pools = pools
        self.device: dict[str, DevicePool] = pools.device_pools()
        self.page = page_size_tokens
        self.rate = prefill_tokens_per_s
        self.groups = client.geometries
        self.rules = {g.name: GroupRule.of(g) for g in client.layer_map.groups}
        self.layer_ids = list(client.layer_map.stage_layer_ids)
        self.free: dict[str, list[int]] = {
            name: list(range(pools.num_pages[name] - 1, -1, -1)) for name in self.groups
        }
        self.resident: list[Resident] = []
        self.refs: dict[str, list[int]] = {
            name: [0] * pools.num_pages[name] for name in self.groups
        }
        self.has_state = any(not r.kind.is_token_cache for r in self.rules.values())
        self.clock = 0
        self.totals = Totals()

    # ---- L1 -----------------------------------------------------------------------------------

    def _l1_match(self, tokens: Sequence[int]) -> tuple[Resident | None, int]:
        """The resident sequence sharing the longest page-aligned prefix with the prompt, and
        that prefix in pages. With state groups (Mamba, linear attention) only a sequence's
        whole length counts: its one snapshot is at its end."""
        best, best_pages = None, 0
        full = len(tokens) // self.page
        for entry in self.resident:
            n = min(len(entry.tokens) // self.page, full)
            k = 0
            while k < n and _page_equal(entry.tokens, tokens, k, self.page):
                k += 1
            if self.has_state and k != len(entry.tokens) // self.page:
                continue
            if k > best_pages:
                best, best_pages = entry, k
        return best, best_pages

    def _need(self, name: str, full_pages: int) -> int:
        return full_pages if self.rules[name].kind.is_token_cache else 1

    def _alloc(self, counts: dict[str, int]) -> dict[str, list[int]]:
        """Fresh pages, evicting the least recently used sequences while short (a page shared
        by several sequences frees with the last of them)."""
        while any(len(self.free[n]) < c for n, c in counts.items()):
            if not self.resident:
                short = {n: c - len(self.free[n]) for n, c in counts.items()}
                raise SystemExit(f"device pool too small for one request: short {short} pages")
            self._drop(min(self.resident, key=lambda e: e.last_used))
            self.totals.l1_evictions += 1
        out = {n: [self.free[n].pop() for _ in range(c)] for n, c in counts.items()}
        for name, pages in out.items():
            for page in pages:
                self.refs[name][page] = 1
        return out

    def _retire(self, entry: Resident) -> None:
        """Retire a sequence whose state snapshot was handed on (its token pages drop their
        reference; the snapshot's reference moves to the new sequence)."""
        self.resident.remove(entry)
        for name, pages in entry.pages.items():
            if self.rules[name].kind.is_token_cache:
                for page in pages:
                    self.refs[name][page] -= 1
                    if self.refs[name][page] == 0:
                        self.free[name].append(page)

    def _share(self, name: str, pages: list[int]) -> list[int]:
        for page in pages:
            self.refs[name][page] += 1
        return list(pages)

    def _drop(self, entry: Resident) -> None:
        self.resident.remove(entry)
        for name, pages in entry.pages.items():
            for page in pages:
                self.refs[name][page] -= 1
                if self.refs[name][page] == 0:
                    self.free[name].append(page)

    # ---- one request -------------------------------------------------------------------------

    def serve(self, tokens: Sequence[int]) -> dict[str, Any]:
        t = self.totals
        self.clock += 1
        full = len(tokens) // self.page
        l1, l1_pages = self._l1_match(tokens)
        hit = self.client.lookup(tokens)
        pages: dict[str, list[int]] = {}
        if l1 is not None:
            l1.last_used = self.clock
            for n in self.groups:
                if self.rules[n].kind.is_token_cache:
                    pages[n] = self._share(n, l1.pages[n][:l1_pages])
                else:  # the snapshot advances in place: the old sequence hands it on
                    pages[n] = list(l1.pages[n])
            if self.has_state:
                self._retire(l1)
        else:
            pages = {n: [] for n in self.groups}
        extra = self._alloc({n: self._need(n, full) - len(pages[n]) for n in self.groups})
        for n in self.groups:
            pages[n] += extra[n]
        hit_pages = l1_pages
        from_l2 = from_l3 = 0
        stall: list[float] = []
        timeline: list[list[float]] = []
        if hit.tokens_total // self.page > l1_pages:
            issued = time.perf_counter()
            handle = self.client.load(tokens, pages, skip_pages=l1_pages)
            if handle is not None:
                hit_pages = handle.tokens // self.page
                self._forward_overlapped(
                    handle, len(tokens) - hit_pages * self.page, stall, timeline, issued
                )
                t.loads += 1
                t.load_failed_pages += sum(len(v) for v in handle.failed.values())
                self._verify(tokens, pages, hit_pages, l1_pages)
                from_l2 = max(0, min(hit.tokens_l2 // self.page, hit_pages) - l1_pages)
                from_l3 = hit_pages - l1_pages - from_l2
        miss_tokens = len(tokens) - hit_pages * self.page
        if not stall and miss_tokens:
            self._compute(miss_tokens)
        self._prefill(tokens, pages, hit_pages, l1_pages, full)
        stored = self._store(tokens, pages, full) if full else {"pages_stored": 0}
        self.resident.append(Resident(tuple(tokens[: full * self.page]), pages, self.clock))
        t.requests += 1
        t.prompt_tokens += len(tokens)
        t.tokens_l1 += l1_pages * self.page
        t.tokens_l2 += from_l2 * self.page
        t.tokens_l3 += from_l3 * self.page
        t.tokens_computed += miss_tokens
        t.stall_s += stall
        extra_fields: dict[str, Any] = {}
        if timeline:
            extra_fields["timeline"] = {"layers": self.layer_ids, "spans": timeline}
        return {
            **extra_fields,
            "tokens": len(tokens),
            "l1": l1_pages * self.page,
            "l2": from_l2 * self.page,
            "l3": from_l3 * self.page,
            "computed": miss_tokens,
            "stored_pages": stored["pages_stored"],
            "stall_ms": round(sum(stall) * 1e3, 3),
        }

    def _store(
        self, tokens: Sequence[int], pages: dict[str, list[int]], full: int
    ) -> dict[str, Any]:
        """Token groups' pages, and each state group's snapshot: its slot holds the state
        after the prompt's last full page (what `_prefill` wrote), so it is filed under
        exactly that many tokens."""
        token_pages = {n: p for n, p in pages.items() if self.rules[n].kind.is_token_cache}
        snapshots = {
            n: {full * self.page: p[0]}
            for n, p in pages.items()
            if not self.rules[n].kind.is_token_cache
        }
        return self.client.store(tokens, token_pages, snapshots)

    def _compute(self, tokens: int) -> None:
        seconds = tokens / self.rate
        self.totals.compute_s += seconds
        time.sleep(seconds)

    def _forward_overlapped(
        self,
        handle: LoadHandle,
        miss_tokens: int,
        stall: list[float],
        timeline: list[list[float]],
        issued: float,
    ) -> None:
        """The forward over the new tokens, layer by layer, each layer after its KV landed.
        `timeline` gets per layer, in seconds since the load was issued: when the wait began,
        when the layer was seen landed, when its simulated compute ended."""
        per_layer = miss_tokens / self.rate / len(self.layer_ids)
        for layer_id in self.layer_ids:
            started = time.perf_counter()
            handle.wait_layer(layer_id)
            ready = time.perf_counter()
            stall.append(ready - started)
            if per_layer:
                time.sleep(per_layer)
            ended = time.perf_counter()
            timeline.append(
                [round(started - issued, 7), round(ready - issued, 7), round(ended - issued, 7)]
            )
        self.totals.compute_s += per_layer * len(self.layer_ids)
        state = handle.done()
        if state != "done":
            raise SystemExit(f"load {handle.load_id} ended {state}")

    def _verify(
        self, tokens: Sequence[int], pages: dict[str, list[int]], hit: int, skip: int
    ) -> None:
        """Check every page the load moved (positions from `skip` on) against the bytes its
        token prefix determines."""
        t = self.totals
        loaded = tuple(tokens[: hit * self.page])
        for name, geom in self.groups.items():
            rule = self.rules[name]
            token_group = rule.kind.is_token_cache
            seeds = seeds_for(loaded, name, token_group, self.page)
            for i in rule.needed(hit, self.page):
                if token_group and i < skip:
                    continue
                page = pages[name][i] if token_group else pages[name][0]
                seed = seeds[i] if token_group else seeds[0]
                t.pages_verified += 1
                t.bytes_verified += geom.page_bytes
                t.bytes_loaded += geom.page_bytes
                t.mismatches += not check_page(self.device[name], page, seed)

    def _prefill(
        self, tokens: Sequence[int], pages: dict[str, list[int]], hit: int, l1: int, full: int
    ) -> None:
        """Write what is not on the device yet: new pages, pages a window load skipped, and
        the state at the prompt's last full page."""
        for name in self.groups:
            rule = self.rules[name]
            pool = self.device[name]
            if rule.kind.is_token_cache:
                seeds = seeds_for(tokens, name, True, self.page)
                have = set(range(l1)) | set(rule.needed(hit, self.page) if hit > l1 else ())
                for i in range(full):
                    if i not in have:
                        fill_page(pool, pages[name][i], seeds[i])
            elif full:
                (seed,) = seeds_for(tokens, name, False, self.page)
                fill_page(pool, pages[name][0], seed)

    def summary(self) -> dict[str, Any]:
        t = self.totals
        out = asdict(t)
        stalls = t.stall_s
        out["stall_s"] = round(sum(stalls), 6)
        out["layer_waits"] = len(stalls)
        out["stall_p50_us"] = round(statistics.median(stalls) * 1e6, 1) if stalls else 0.0
        out["stall_p99_us"] = (
            round(sorted(stalls)[int(len(stalls) * 0.99)] * 1e6, 1) if stalls else 0.0
        )
        hit_tokens = t.tokens_l1 + t.tokens_l2 + t.tokens_l3
        out["prefill_saved_s"] = round(hit_tokens / self.rate, 3)
        out["prefill_tokens_per_s"] = self.rate
        return out


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hicache.demo.engine")
    parser.add_argument("--config", required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--device-pages", type=int, default=64)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=50_000.0)
    for name, default in asdict(TraceOptions()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    args = parser.parse_args(argv)
    loaded = load_deployment(args.config)
    opts = TraceOptions(**{k: getattr(args, k) for k in asdict(TraceOptions())})
    trace = build_trace(opts)
    client = connect_deployment(loaded, address=args.socket, engine="hicache-demo")
    try:
        # a state group needs a slot per resident sequence, not per page: a few will do (a
        # large hybrid's snapshot is tens of MiB)
        pools = client.create_pools(
            {
                name: args.device_pages
                if g.group.kind.is_token_cache
                else min(4, args.device_pages)
                for name, g in client.geometries.items()
            }
        )
        client.register_pools(pools)
        engine = SyntheticEngine(client, pools, client.page_size_tokens, args.prefill_tokens_per_s)
        emit("start", requests=len(trace), device_pages=args.device_pages)
        started = time.perf_counter()
        for i, request in enumerate(trace):
            emit("request", index=i, name=request.name, **engine.serve(request.tokens))
        engine.totals.wall_s = time.perf_counter() - started
        emit("summary", **engine.summary(), sidecar=client.stats())
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
