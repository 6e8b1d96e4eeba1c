"""The eviction rule of an L2 shared by tenants (`cache.shares.L2Shares`), driven through each
tenant's real planner and index over one real host tier: a tenant under its guaranteed share
loses no page to another's stores; a tenant over its share gives back its excess, down to
its share and no further; a cap holds whatever is free; unlisted tenants share the rest in
one least-recently-used order; a page another tenant pins is never taken."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from hicache.assembly import by_key
from hicache.cache import TieredCache
from hicache.cache.shares import REST, L2Shares, ShareRule
from hicache.memory import GroupGeometry
from hicache.model import LayerMap, load_layout
from tests.conftest import shared_model

PAGE = 2
POOL_PAGES = 20
PROMPT_PAGES = 2


@contextmanager
def tenants(
    listed: dict[str, ShareRule],
    rest: float,
    names: list[str],
    policies: dict[str, str] | None = None,
) -> Iterator[tuple[L2Shares, dict[str, TieredCache]]]:
    """One tiered cache per tenant name (its write policy from `policies`, else
    write-through), all on one host tier of POOL_PAGES pages."""
    layer_map = LayerMap(load_layout(shared_model("qwen2_7b.json")))
    per_page = sum(
        g.page_bytes for g in (GroupGeometry(x, torch.float16, PAGE) for x in layer_map.groups)
    )
    caches: dict[str, TieredCache] = {}
    shares: L2Shares | None = None
    try:
        for name in names:
            embedded = by_key.embedded(
                layer_map,
                dtype=torch.float16,
                page_size_tokens=PAGE,
                host_capacity_bytes=POOL_PAGES * per_page,
                device_pages=PROMPT_PAGES,
                host_tier=None if shares is None else shares.host_tier,
            )
            policy = (policies or {}).get(name, "write_through")
            cache = caches[name] = by_key.tiered(embedded, tenant=name, write_policy=policy)
            if shares is None:
                shares = L2Shares(embedded.host_tier, listed, ShareRule(rest))
            shares.join(name, cache.planner)
        assert shares is not None
        yield shares, caches
    finally:
        for cache in caches.values():
            cache.embedded.close()


def store(cache: TieredCache, prompt: int) -> int:
    """Plan and commit one prompt's store (no copy: the rule is the planner's); the pages
    it stored."""
    tokens = [prompt * 1000 + t for t in range(PROMPT_PAGES * PAGE)]
    keys = cache.index.keys(tokens)
    plan = cache.planner.plan_store(keys, {g: [(i, i) for i in range(PROMPT_PAGES)] for g in keys})
    cache.planner.commit_store(plan)
    return sum(len(g.keys) for g in plan.groups.values())


def held(shares: L2Shares, tenant: str) -> int:
    return sum(s.held_pages for s in shares.stats()[tenant].values())


def hit(cache: TieredCache, prompt: int) -> bool:
    tokens = [prompt * 1000 + t for t in range(PROMPT_PAGES * PAGE)]
    return cache.lookup(tokens).pages_l2 == PROMPT_PAGES


def test_a_tenant_within_its_share_keeps_every_page_through_a_flood() -> None:
    with tenants({"a": ShareRule(0.4)}, 0.6, ["a", "b"]) as (shares, caches):
        for p in range(4):  # 8 pages: A's whole share
            assert store(caches["a"], p) == PROMPT_PAGES
        for p in range(100, 140):  # B floods: 80 pages through a 12-page rest
            assert store(caches["b"], p) == PROMPT_PAGES
        assert all(hit(caches["a"], p) for p in range(4))
        assert held(shares, "a") == 8
        assert held(shares, "b") == 12
        a, b = shares.stats()["a"], shares.stats()["b"]
        assert sum(s.evicted_pages for s in a.values()) == 0
        assert sum(s.evicted_by_others_pages for s in b.values()) == 0
        assert sum(s.evicted_pages for s in b.values()) == 80 - 12
        for cache in caches.values():
            cache.planner.check()


def test_a_tenant_over_its_share_gives_back_its_excess_and_no_more() -> None:
    with tenants({"a": ShareRule(0.4)}, 0.6, ["a", "b"]) as (shares, caches):
        for p in range(8):  # A borrows: 16 of 20 pages while B is idle
            assert store(caches["a"], p) == PROMPT_PAGES
        assert held(shares, "a") == 16
        for p in range(100, 120):  # B takes the 4 free pages, then A's 8 of excess, then its own
            assert store(caches["b"], p) == PROMPT_PAGES
        assert held(shares, "a") == 8  # its share, no less
        assert held(shares, "b") == 12
        # A's least recently stored prompts went first
        assert [hit(caches["a"], p) for p in range(8)] == [False] * 4 + [True] * 4
        a = shares.stats()["a"]
        assert sum(s.evicted_by_others_pages for s in a.values()) == 8


def test_a_cap_bounds_a_tenant_even_when_l2_is_free() -> None:
    with tenants({"a": ShareRule(0.2, cap=0.5)}, 0.8, ["a", "b"]) as (shares, caches):
        for p in range(8):  # 16 pages asked; the cap is 10: A evicts its own beyond it
            assert store(caches["a"], p) == PROMPT_PAGES
        assert held(shares, "a") == 10
        assert shares.host_tier.pool("full").allocator.stats().free_pages == 10
        a = shares.stats()["a"]
        assert sum(s.evicted_pages - s.evicted_by_others_pages for s in a.values()) == 6


def test_unlisted_tenants_share_the_rest_in_one_lru_order() -> None:
    with tenants({"a": ShareRule(0.5)}, 0.5, ["a", "b", "c"]) as (shares, caches):
        assert shares.holder("b") == shares.holder("c") == REST
        for p in range(10):  # B borrows: all 20 pages
            store(caches["b"], p)
        store(caches["a"], 50)  # takes B's oldest prompt (the rest is over its share)
        for p in range(200, 203):  # C's stores take B's next oldest: one order for the rest
            store(caches["c"], p)
        assert [hit(caches["b"], p) for p in range(10)] == [False] * 4 + [True] * 6
        assert hit(caches["a"], 50)
        assert all(hit(caches["c"], p) for p in range(200, 203))
        b = shares.stats()["b"]
        assert sum(s.evicted_by_others_pages for s in b.values()) == 8


def test_a_pinned_page_of_another_tenant_is_never_taken() -> None:
    with tenants({"a": ShareRule(0.5)}, 0.5, ["a", "b"]) as (shares, caches):
        for p in range(10):  # B borrows all 20 pages
            store(caches["b"], p)
        b_index = caches["b"].index
        pinned = [r.key for r in b_index.l2_records("full")]
        b_index.pin("full", pinned)  # a load of B's holds every page
        assert store(caches["a"], 50) == 0  # nothing to take: A stores nothing, fails nothing
        b_index.unpin("full", pinned)
        assert store(caches["a"], 50) == PROMPT_PAGES
        assert held(shares, "a") == 2
        for cache in caches.values():
            cache.planner.check()


def test_a_dirty_page_of_another_tenant_is_never_taken() -> None:
    """B writes back (its pages are L3's only once evicted by B itself, persisted first):
    another tenant's store may not drop them unwritten."""
    with tenants({"a": ShareRule(0.5)}, 0.5, ["a", "b"], {"b": "write_back"}) as (
        shares,
        caches,
    ):
        for p in range(10):  # B borrows all 20 pages, none in L3
            store(caches["b"], p)
        assert store(caches["a"], 50) == 0
        assert held(shares, "b") == 20
        assert all(hit(caches["b"], p) for p in range(10))


def test_a_tenant_joins_one_shared_l2_once() -> None:
    with (
        tenants({}, 1.0, ["a"]) as (shares, caches),
        pytest.raises(ValueError, match=r"^tenant 'a' already shares this L2$"),
    ):
        shares.join("a", caches["a"].planner)
