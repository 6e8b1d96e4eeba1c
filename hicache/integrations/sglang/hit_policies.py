"""SGLang's v2 hit policies over what the sidecar serves, pure (no SGLang, no sidecar here).

SGLang's `batch_exists_v2(keys, pool_transfers)` asks, for a request's page keys, how long a
prefix it can restore when every pool is satisfied. The rules (SGLang 0.5.23's
`PoolHitPolicy` and `PoolTransferResult`, `HiCacheFile.batch_exists_v2` the reference):

- KV: the leading run of the keys whose pages are stored, `kv_pages`; lengths 1..kv_pages;
- an ALL_PAGES side pool: the leading run of its own pages, capped at kv_pages;
- a TRAILING_PAGES side pool with a window of W pages (W = the transfer's key count, at least
  1: Mamba's state is W = 1, SWA's window W > 1): a length p is restorable when the pool holds
  pages p-W .. p-1, i.e. the state stored at the boundary p (not monotone: a state can exist
  after 4 and 8 pages and not after 6);
- `restorable_prefix_pages`: the lengths every pool allows, ascending; `kv_hit_pages` its last
  (0 when none); per pool the longest length it alone allows within 1..kv_pages.

hicache answers per group which of the prompt's pages it holds (`Client.served_keys`), each as
the length ending with it: the KV group 1..its leading run, a state group the lengths after
which a snapshot is stored (the snapshot after p pages is filed under the key of page p-1),
a sliding group each page it holds. So `held[pool]` is the set of p whose page p-1 the pool's
group holds, and the windows are applied here, with SGLang's sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"


@dataclass(frozen=True, slots=True)
class PoolAsk:
    """One side pool of the query: its SGLang name, hit policy and window (trailing pools)."""

    name: str
    policy: str
    window: int = 1


@dataclass(frozen=True, slots=True)
class Restorable:
    kv_hit_pages: int
    pool_hits: dict[str, int]  # per pool (KV included) the longest length it alone allows
    lengths: list[int]  # every length all pools allow, ascending


def restorable(kv_pages: int, asks: Sequence[PoolAsk], held: Mapping[str, set[int]]) -> Restorable:
    """The rules above. `held[name]`: the lengths whose last page the pool holds (for a
    state group, the lengths a snapshot is stored after). A pool with an unknown policy
    allows nothing (no hit, never an error: the data path does not raise)."""
    lengths = set(range(1, kv_pages + 1))
    hits = {"kv": kv_pages} if kv_pages else {}
    for ask in asks:
        if not lengths:
            break
        have = held.get(ask.name, set())
        if ask.policy == ALL_PAGES:
            end = next((p for p in range(1, kv_pages + 1) if p not in have), kv_pages + 1) - 1
            allowed = set(range(1, end + 1))
        elif ask.policy == TRAILING_PAGES:
            window = max(1, ask.window)  # only lengths the pool holds can end a window
            allowed = {
                p
                for p in have
                if 1 <= p <= kv_pages and all(q in have for q in range(max(1, p - window + 1), p))
            }
        else:
            allowed = set()
        if allowed:
            hits[ask.name] = max(allowed)
        lengths &= allowed
    ordered = sorted(lengths)
    return Restorable(ordered[-1] if ordered else 0, hits, ordered)
