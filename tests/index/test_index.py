"""Page keys, hybrid-aware lookup on real layouts, eviction strategies, policies, and the
index's invariants under any sequence of operations (hypothesis)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.errors import ConfigError, PinError
from hicache.index import (
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    AbsentKeys,
    GroupRule,
    LruPolicy,
    Namespace,
    PageIndexError,
    PageKeyer,
    PageRecord,
    PrefixIndex,
    S3FifoPolicy,
)
from hicache.model import LayerMap, load_layout
from tests.conftest import shared_model

NS = Namespace(
    model="m", dtype="bfloat16", kv_layout="full:mha:8x128", page_size_tokens=4, group="full"
)


def test_keys_chain_and_cover_full_pages_only() -> None:
    keyer = PageKeyer(NS)
    keys = keyer.keys(list(range(10)))
    assert len(keys) == 2  # the 2-token tail has no key
    assert all(len(k) == 16 for k in keys)
    assert keyer.keys(list(range(8))) == keys
    # the chain: a change in page 0 changes every later key
    changed = keyer.keys([99, *range(1, 8)])
    assert changed[0] != keys[0]
    assert changed[1] != keys[1]
    # same tokens in page 1 after different page 0 differ
    assert keyer.keys([5, 5, 5, 5, 4, 5, 6, 7])[1] != keys[1]


@pytest.mark.parametrize("field", ["tenant_salt", "dtype", "group", "tp_rank", "model"])
def test_namespace_separates_keys(field: str) -> None:
    other = dataclasses.replace(NS, **{field: "x" if isinstance(getattr(NS, field), str) else 1})
    assert PageKeyer(other).keys(list(range(4))) != PageKeyer(NS).keys(list(range(4)))


def test_algorithms() -> None:
    tokens = list(range(8))
    assert PageKeyer(NS, "sha256").keys(tokens) != PageKeyer(NS, "blake2b").keys(tokens)
    with pytest.raises(
        ConfigError,
        match=r"^page key algorithm 'md5' is not supported; allowed: sha256, blake2b, xxh3_128$",
    ):
        PageKeyer(NS, "md5")


def make_index(
    model: str, capacity: int = 64, page: int = 16, eviction: str = "lru", l3_only: int = 262_144
) -> PrefixIndex:
    layer_map = LayerMap(load_layout(shared_model(model)))
    keyers, rules = {}, {}
    for group in layer_map.groups:
        ns = Namespace(model, "bfloat16", group.kind.value, page, group.name)
        keyers[group.name] = PageKeyer(ns)
        rules[group.name] = GroupRule.of(group)
    return PrefixIndex(keyers, rules, {g: capacity for g in rules}, page, eviction, l3_only)


def store_prefix(index: PrefixIndex, tokens: list[int], *, l3: bool = False) -> None:
    next_page = {g: index.l2_pages(g) for g in index.rules}
    for group, keys in index.keys(tokens).items():
        positions = range(len(keys)) if index.rules[group].kind.is_token_cache else [len(keys) - 1]
        for i in positions:
            record = index.record(group, keys[i])
            if l3:
                index.mark_l3(group, keys[i])
            elif record is None or record.l2_page is None:
                index.insert_l2(group, keys[i], next_page[group])
                next_page[group] += 1


def test_full_attention_prefix_hit() -> None:
    index = make_index("qwen2_7b.json")
    tokens = list(range(100))  # 6 full pages of 16
    store_prefix(index, tokens[:64])  # 4 pages stored
    hit = index.lookup(tokens)
    assert (hit.pages_l2, hit.pages_total, hit.tokens_total) == (4, 4, 64)
    assert [i for i, _ in hit.needed["full"]] == [0, 1, 2, 3]


def test_sliding_group_needs_only_the_window_tail() -> None:
    index = make_index("gpt_oss_20b.json")  # window 128 = 8 pages of 16
    tokens = list(range(20 * 16))
    store_prefix(index, tokens)
    keys = index.keys(tokens)
    for i in range(0, 5):  # evict old sliding pages: outside every window that matters
        index.drop_l2("sliding", keys["sliding"][i])
    hit = index.lookup(tokens)
    assert hit.pages_total == 20
    assert [i for i, _ in hit.needed["sliding"]] == list(range(12, 20))
    # any prefix of h <= 12 pages needs a sliding page among 0..4 (window tail or the start)
    assert index.lookup(tokens[: 12 * 16]).pages_total == 0


def test_state_group_needs_a_snapshot_at_the_boundary() -> None:
    index = make_index("qwen3_next_80b.json")
    tokens = list(range(10 * 16))
    store_prefix(index, tokens[: 6 * 16])  # full pages 0..5 and a linear snapshot at 6
    assert index.lookup(tokens).pages_total == 6
    keys = index.keys(tokens)
    index.drop_l2("linear", keys["linear"][5])  # the only snapshot
    hit = index.lookup(tokens)
    assert hit.pages_total == 0  # full pages alone are no usable hit for a hybrid
    store_prefix(index, tokens[: 3 * 16])  # a snapshot at 3 pages
    assert index.lookup(tokens).pages_total == 3


def test_l3_hits_count_in_total_not_l2() -> None:
    index = make_index("qwen2_7b.json")
    tokens = list(range(8 * 16))
    store_prefix(index, tokens[: 3 * 16])
    keys = index.keys(tokens)["full"]
    for i in range(3, 8):
        index.mark_l3("full", keys[i])
    hit = index.lookup(tokens)
    assert (hit.pages_l2, hit.pages_total) == (3, 8)


def test_pins_block_eviction_and_capacity_is_enforced() -> None:
    index = make_index("qwen2_7b.json", capacity=3)
    tokens = list(range(3 * 16))
    store_prefix(index, tokens)
    keys = index.keys(tokens)["full"]
    with pytest.raises(
        PageIndexError,
        match=r"^group 'full': L2 holds 3 of 3 pages; evict \(l2_victims \+ drop_l2\) before inserting$",
    ):
        index.insert_l2("full", b"\0" * 16, 9)
    index.pin("full", keys[:2])
    victims = index.l2_victims("full", 3)
    assert [v.key for v in victims] == [keys[2]]
    with pytest.raises(PinError, match=r"is pinned \(1\); it cannot leave L2$"):
        index.drop_l2("full", keys[0])
    index.unpin("full", keys[:2])
    with pytest.raises(PinError, match=r"is not pinned$"):
        index.unpin("full", keys[:1])


def test_lru_order_and_touch() -> None:
    lru = LruPolicy()
    for k in "abcd":
        lru.insert(k)
    lru.touch("a")
    assert lru.victims(2, lambda k: True) == ["b", "c"]
    assert lru.victims(2, lambda k: k != "b") == ["c", "d"]


def test_s3fifo_resists_a_scan() -> None:
    policy = S3FifoPolicy(capacity=20)
    hot = [f"hot{i}" for i in range(5)]
    for k in hot:
        policy.insert(k)
        policy.touch(k)
    evicted: set[str] = set()
    for i in range(200):  # a one-pass scan of cold keys, evicting to stay within 20
        key = f"cold{i}"
        policy.insert(key)
        if len(policy) > 20:
            for victim in policy.victims(len(policy) - 20, lambda k: True):
                policy.remove(victim)
                evicted.add(str(victim))
        for k in hot:
            policy.touch(k)
    assert not evicted & set(hot)
    lru = LruPolicy()
    for k in hot:
        lru.insert(k)
    for i in range(200):  # the same scan flushes LRU's hot keys
        lru.insert(f"cold{i}")
        if len(lru) > 20:
            for victim in lru.victims(len(lru) - 20, lambda k: True):
                lru.remove(victim)
    assert all(k not in lru.victims(100, lambda k: True) for k in hot)


def test_policies() -> None:
    record = PageRecord(b"k", l2_page=1)
    assert WRITE_POLICIES["write_through"]().on_store(record)
    selective = WRITE_POLICIES["write_through_selective"](min_hits=2)
    record.hits = 1
    assert not selective.on_hit(record)
    record.hits = 2
    assert selective.on_hit(record)
    assert WRITE_POLICIES["write_back"]().on_evict(record)
    record.in_l3 = True
    assert not WRITE_POLICIES["write_back"]().on_evict(record)
    assert PREFETCH_POLICIES["best_effort"]().wait_s(1000) == 0.0
    assert PREFETCH_POLICIES["wait_complete"]().wait_s(1000) is None
    timeout = PREFETCH_POLICIES["timeout"](base_s=0.01, per_token_s=0.001)
    assert timeout.wait_s(1000) == pytest.approx(1.01)
    assert timeout.wait_s(2000) > timeout.wait_s(1000)


ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "store_l3", "lookup", "evict", "pin", "unpin"]),
        st.integers(1, 12),
        st.integers(0, 3),
    ),
    max_size=40,
)


@settings(max_examples=120, deadline=None)
@given(ops, st.sampled_from(["lru", "s3fifo"]))
def test_invariants_under_any_sequence(sequence: list[tuple[str, int, int]], eviction: str) -> None:
    index = make_index("gpt_oss_20b.json", capacity=10, page=16, eviction=eviction, l3_only=5)
    prompts = [list(range(p * 1000, p * 1000 + 12 * 16)) for p in range(4)]
    pinned: list[tuple[str, bytes]] = []
    free_page = {g: iter(range(10_000)) for g in index.rules}
    for op, n, which in sequence:
        tokens = prompts[which][: n * 16]
        keys = index.keys(tokens)
        if op in ("store", "store_l3"):
            for group, group_keys in keys.items():
                for key in group_keys:
                    record = index.record(group, key)
                    if op == "store_l3":
                        index.mark_l3(group, key)
                    elif record is None or record.l2_page is None:
                        if index.l2_pages(group) >= index.capacity[group]:
                            for victim in index.l2_victims(group, 1):
                                assert victim.pins == 0  # never a pinned page
                                index.drop_l2(group, victim.key)
                        if index.l2_pages(group) < index.capacity[group]:
                            index.insert_l2(group, key, next(free_page[group]))
        elif op == "lookup":
            hit = index.lookup(prompts[which])
            assert hit.pages_l2 <= hit.pages_total
            for group, rows in hit.needed.items():  # every hit is servable
                assert [i for i, _ in rows] == list(index.rules[group].needed(hit.pages_total, 16))
                for _, record in rows:
                    assert record.l2_page is not None or record.in_l3
        elif op == "evict":
            for group in index.rules:
                for victim in index.l2_victims(group, n):
                    assert victim.pins == 0
                    index.drop_l2(group, victim.key)
        elif op == "pin":
            for group, group_keys in keys.items():
                for key in group_keys[:1]:
                    record = index.record(group, key)
                    if record is not None and record.l2_page is not None:
                        index.pin(group, [key])
                        pinned.append((group, key))
        elif op == "unpin" and pinned:
            group, key = pinned.pop()
            index.unpin(group, [key])
        for group in index.rules:  # the budget is never exceeded; pinned pages stay in L2
            assert index.l2_pages(group) <= index.capacity[group]
        for group, key in pinned:
            record = index.record(group, key)
            assert record is not None
            assert record.l2_page is not None
        for group in index.rules:  # L3-only records are bounded, and all of them are counted
            only = [r for r in index.l3_records(group) if r.l2_page is None]
            assert index.l3_only_pages(group) == len(only) <= 5
            held = {key for g, key in pinned if g == group}
            assert index.pinned_pages(group) == len(held)  # the running count stays exact


def test_l3_only_records_are_bounded_least_recent_first() -> None:
    index = make_index("qwen2_7b.json", capacity=4, page=16, l3_only=3)
    prompts = [list(range(p * 100, p * 100 + 16)) for p in range(6)]  # one page each
    keys = [index.keys(tokens)["full"][0] for tokens in prompts]
    for key in keys[:3]:
        index.mark_l3("full", key)
    assert (
        index.lookup(prompts[0], touch=True).pages_total == 1
    )  # a load makes page 0 the most recent
    index.mark_l3("full", keys[3])  # over the bound: the least recent (page 1) goes
    assert index.record("full", keys[1]) is None
    assert [index.record("full", k) is not None for k in keys[:4]] == [True, False, True, True]
    assert index.l3_forgotten["full"] == 1
    # a page in L2 as well is not L3-only; when L2 drops it, it becomes the most recent one
    index.insert_l2("full", keys[4], 0)
    index.mark_l3("full", keys[4])
    assert index.l3_only_pages("full") == 3
    index.drop_l2("full", keys[4])
    assert index.record("full", keys[2]) is None  # the least recent went to make room
    assert index.l3_only_pages("full") == 3
    # a pinned record (a fetch in flight) is never forgotten: the next one goes instead
    index.pin("full", [keys[0]])
    index.mark_l3("full", keys[5])
    assert index.record("full", keys[0]) is not None
    assert index.record("full", keys[3]) is None
    index.unpin("full", [keys[0]])
    assert index.l3_forgotten["full"] == 3
    with pytest.raises(PageIndexError, match="l3_only_max_pages is 0; it must be >= 1"):
        make_index("qwen2_7b.json", l3_only=0)


def test_absent_keys_expire_and_are_bounded() -> None:
    now = [0.0]
    absent = AbsentKeys(2.0, max_keys=3, clock=lambda: now[0])
    absent.add([("full", b"a"), ("full", b"b")])
    assert absent.fresh("full", b"a")
    assert not absent.fresh("swa", b"a")  # per group
    now[0] = 1.9
    absent.add([("full", b"c"), ("full", b"d")])  # over the bound: the oldest answer goes
    assert not absent.fresh("full", b"a")
    assert absent.fresh("full", b"b")
    now[0] = 2.0
    assert not absent.fresh("full", b"b")  # expired
    assert absent.fresh("full", b"c")
    assert len(absent) == 2
    off = AbsentKeys(0.0)
    off.add([("full", b"a")])
    assert not off.fresh("full", b"a")
    with pytest.raises(ValueError, match="ttl_s is -1 and max_keys 0; ttl_s must be >= 0 and"):
        AbsentKeys(-1, max_keys=0)
