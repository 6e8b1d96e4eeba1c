"""Lookups by page keys: `PackedKeys` (a blob of concatenated keys), keyers rebuilt from their
root, and `PrefixIndex.lookup_keys` against the token lookup and a brute-force reference on
hybrid layouts (sliding + full, linear / conv / mamba state + full, chunked) after random
stores, evictions, L3 marks and drops; `Discovery.needed_keys` never skips an L3 question
that could extend a hit."""

from __future__ import annotations

import asyncio
import copy
import random

import pytest

from hicache.cache.discovery import Discovery
from hicache.errors import ConfigError
from hicache.index import (
    KEY_BYTES,
    AbsentKeys,
    Hit,
    Namespace,
    PackedKeys,
    PageIndexError,
    PageKey,
    PageKeyer,
    PrefixIndex,
)
from tests.index.test_index import NS, make_index

PAGE = 16
LAYOUTS = [
    "gpt_oss_20b.json",  # sliding (window 128) + full
    "qwen3_next_80b.json",  # linear state + full
    "lfm2_350m.json",  # conv state + full
    "nemotron_h_8b.json",  # mamba state + full
    "llama4_scout.json",  # chunked + full
]


def test_packed_keys_slice_and_index_like_the_list() -> None:
    keys = PageKeyer(NS).keys(list(range(40)))  # 10 pages of 4
    packed = PackedKeys.of(keys)
    assert len(packed) == 10
    assert packed.blob == b"".join(keys)
    assert [packed[i] for i in range(10)] == keys
    assert packed[-1] == keys[-1]
    assert list(packed[2:7]) == keys[2:7]
    assert list(packed[8:3]) == []
    assert list(packed[::3]) == keys[::3]
    assert list(packed) == keys
    with pytest.raises(IndexError):
        packed[10]
    with pytest.raises(ValueError, match=r"a multiple of 16 bytes \(got 33\)"):
        PackedKeys(b"x" * 33)


@pytest.mark.parametrize("algorithm", ["xxh3_128", "blake2b", "sha256"])
def test_a_keyer_from_its_root_gives_the_same_keys(algorithm: str) -> None:
    keyer = PageKeyer(NS, algorithm)
    again = PageKeyer.from_root(keyer.root, NS.page_size_tokens, algorithm)
    tokens = list(range(1000, 1043))  # 10 full pages and a 3-token tail
    assert again.keys(tokens) == keyer.keys(tokens)
    # a growing prompt keys only its new pages, chained on the last key it had
    head = keyer.keys(tokens[:20])
    tail = keyer.keys_of_bytes(keyer.token_bytes(tokens)[20 * 4 :], previous=head[-1])
    assert head + tail == keyer.keys(tokens)
    other = PageKeyer.from_root(bytes(KEY_BYTES), NS.page_size_tokens, algorithm)
    assert not set(other.keys(tokens)) & set(keyer.keys(tokens))  # another root: no key shared
    with pytest.raises(ConfigError, match=r"a keyer's root is 16 bytes \(got 3\)"):
        PageKeyer.from_root(b"abc", 4, algorithm)


def reference(index: PrefixIndex, keys: dict[str, list[PageKey]], skip: int) -> tuple[int, int]:
    """The hit by definition: the longest h every group serves, checked page by page."""
    pages = min(len(k) for k in keys.values())
    skip = min(skip, pages)

    def serves(h: int, l2_only: bool) -> bool:
        for group, group_keys in keys.items():
            for i in index.rules[group].needed(h, PAGE):
                record = index.record(group, group_keys[i])
                if i >= skip and (
                    record is None or (record.l2_page is None and (l2_only or not record.in_l3))
                ):
                    return False
        return True

    def longest(l2_only: bool) -> int:
        return next((h for h in range(pages, 0, -1) if h <= skip or serves(h, l2_only)), 0)

    return longest(True), longest(False)


def rows(hit: Hit) -> dict[str, list[tuple[int, bytes]]]:
    return {g: [(i, r.key) for i, r in found] for g, found in hit.needed.items()}


def random_ops(index: PrefixIndex, rng: random.Random, prompts: list[list[int]], steps: int):  # type: ignore[no-untyped-def]
    """Stores, evictions, L3 marks and drops at random; yields after each step."""
    free = {g: iter(range(1_000_000)) for g in index.rules}
    for _ in range(steps):
        tokens = rng.choice(prompts)[: rng.randrange(0, 14) * PAGE + rng.randrange(PAGE)]
        keys = index.keys(tokens)
        op = rng.choice(["store", "store", "store_l3", "drop_l2", "drop_l3", "evict"])
        for group, group_keys in keys.items():
            if not group_keys:
                continue
            token_group = index.rules[group].kind.is_token_cache
            positions = range(len(group_keys)) if token_group else [len(group_keys) - 1]
            if op == "store":
                for i in positions:
                    record = index.record(group, group_keys[i])
                    if (record is None or record.l2_page is None) and rng.random() < 0.9:
                        while index.l2_pages(group) >= index.capacity[group]:
                            (victim,) = index.l2_victims(group, 1)
                            index.drop_l2(group, victim.key)
                        index.insert_l2(group, group_keys[i], next(free[group]))
            elif op == "store_l3":
                index.mark_l3_many(group, [group_keys[i] for i in positions if rng.random() < 0.9])
            else:
                i = rng.randrange(len(group_keys))
                record = index.record(group, group_keys[i])
                if op == "drop_l2" and record is not None and record.l2_page is not None:
                    index.drop_l2(group, group_keys[i])
                elif op == "drop_l3" and record is not None and record.in_l3:
                    index.drop_l3(group, group_keys[i])
                elif op == "evict":
                    for victim in index.l2_victims(group, rng.randrange(1, 4)):
                        index.drop_l2(group, victim.key)
        yield


def prompts_for(rng: random.Random) -> list[list[int]]:
    """Prompts that share prefixes (a system prompt, then conversations), 14 pages long."""
    system = [rng.randrange(50_000) for _ in range(4 * PAGE)]
    out = []
    for _ in range(4):
        turn = [rng.randrange(50_000) for _ in range(rng.randrange(2, 6) * PAGE)]
        out.append((system + turn + [rng.randrange(50_000) for _ in range(14 * PAGE)])[: 14 * PAGE])
    out.append([rng.randrange(50_000) for _ in range(14 * PAGE)])  # shares nothing
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", range(6))
def test_key_lookup_answers_as_the_token_lookup_and_the_definition(layout: str, seed: int) -> None:
    rng = random.Random(seed)
    index = make_index(layout, capacity=40, page=PAGE, l3_only=30)
    prompts = prompts_for(rng)
    for _ in random_ops(index, rng, prompts, 120):
        index.check_l2_keys()
        tokens = rng.choice(prompts)[: rng.randrange(0, 15) * PAGE + rng.randrange(PAGE)]
        skip = rng.choice([0, 0, rng.randrange(0, 6)])
        keys = index.keys(tokens)
        packed = {g: PackedKeys.of(k) for g, k in keys.items()}
        by_tokens = index.lookup(tokens, skip_pages=skip)
        by_keys = index.lookup_keys(packed, skip_pages=skip)
        counts = index.lookup_keys(packed, skip_pages=skip, rows=False)
        expected = reference(index, keys, skip)
        assert (by_tokens.pages_l2, by_tokens.pages_total) == expected
        assert (by_keys.pages_l2, by_keys.pages_total) == expected
        assert (counts.pages_l2, counts.pages_total, counts.needed) == (*expected, {})
        assert rows(by_keys) == rows(by_tokens)


def test_key_lookup_names_the_groups_it_needs() -> None:
    index = make_index("gpt_oss_20b.json")
    keys = index.keys(list(range(64)))
    with pytest.raises(PageIndexError, match=r"keys name groups \['full'\]; this index keys"):
        index.lookup_keys({"full": keys["full"]})


@pytest.mark.parametrize("layout", ["gpt_oss_20b.json", "lfm2_350m.json", "llama4_scout.json"])
@pytest.mark.parametrize("seed", range(6))
def test_discovery_skips_only_questions_that_cannot_extend_the_hit(layout: str, seed: int) -> None:
    """`needed_keys` says no only when L3 holding every page the index does not know (and
    did not just hear is absent) would leave the hit as it is (checked against a copy of the
    index where L3 holds all of those); it says yes only when such a page exists."""
    rng = random.Random(seed)
    index = make_index(layout, capacity=40, page=PAGE, l3_only=30)
    prompts = prompts_for(rng)
    absent = AbsentKeys(60.0)
    discovery = Discovery(index, absent, lambda: None)
    for _ in random_ops(index, rng, prompts, 60):
        tokens = rng.choice(prompts)[: rng.randrange(1, 15) * PAGE]
        keys = index.keys(tokens)
        unknown = [
            (g, k) for g, group_keys in keys.items() for k in group_keys if not index.record(g, k)
        ]
        absent.add([u for u in unknown if rng.random() < 0.4])  # some answered "absent"
        hit = index.lookup(tokens)
        packed = {g: PackedKeys.of(k) for g, k in keys.items()}
        asked = discovery.needed_keys(packed, hit)
        askable = [
            (g, k)
            for g, group_keys in keys.items()
            for k in group_keys[hit.pages_total :]
            if index.record(g, k) is None and not absent.fresh(g, k)
        ]
        if asked:
            assert askable  # the old check asked too
        best = copy.deepcopy(index)  # L3 holds every page it could be asked about
        for group, key in askable:
            best.mark_l3_many(group, [key])
        best.l3_only_max_pages = 1 << 30
        if not asked:
            assert best.lookup(tokens).pages_total == hit.pages_total


def test_discovery_by_keys_records_what_l3_holds() -> None:
    index = make_index("gpt_oss_20b.json", page=PAGE)
    tokens = list(range(6 * PAGE))
    keys = index.keys(tokens)

    class L3:
        async def exists_answered(self, asked: list[bytes]) -> tuple[list[bool], bool]:
            held = set(keys["full"][:4]) | set(keys["sliding"][:4])
            return [k in held for k in asked], True

    store = L3()
    discovery = Discovery(index, AbsentKeys(60.0), lambda: store)  # type: ignore[arg-type,return-value]
    packed = {g: PackedKeys.of(k) for g, k in keys.items()}
    assert discovery.needed_keys(packed, index.lookup_keys(packed))
    assert asyncio.run(discovery.run_keys(store, packed)) == 8  # type: ignore[arg-type]
    assert index.lookup_keys(packed).pages_total == 4
    assert not discovery.needed_keys(packed, index.lookup_keys(packed))  # absent: remembered


def test_namespaced_keys_never_meet() -> None:
    """Keys are the namespace's: another tenant's keys of the same tokens are other keys."""
    ours = PageKeyer(Namespace("m", "bf16", "full", PAGE, "full", tenant_salt="\x00acme"))
    theirs = PageKeyer(Namespace("m", "bf16", "full", PAGE, "full", tenant_salt="\x00globex"))
    tokens = list(range(8 * PAGE))
    assert not set(ours.keys(tokens)) & set(theirs.keys(tokens))
