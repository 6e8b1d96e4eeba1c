"""Real model math through the embedded cache (`EmbeddedCache` + `TieredCache`, in process):
after hicache stores a prompt's cache and loads it back, each family's tiny model continues
exactly as it does from its own cache (harness.py says how), with the hit the case expects.

Cases: prompts on and off page boundaries at pages of 4 and 16 tokens; B extending A, B
diverging mid-prompt (a shorter hit, so state models need the snapshot at that shorter
boundary), B equal to A (the engine looks up B[:-1]); sliding and chunked groups whose engine
freed out-of-window pages before storing (a hit that would need them is shorter, never wrong);
a prompt stored turn by turn; pages the engine still holds (`skip_pages`); a load from L3 after
L2 is emptied, in both host layouts. Defect detectors show the comparison can fail: a snapshot
filed under the wrong length, and a page read in another's place. And the store's snapshot
API: a length off a page boundary is refused, and token pages alone give a state model no hit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from hicache.assembly import by_key
from hicache.scheduler import OpRequestError
from tests.real_models.families import FAMILIES, SLIDING_FAMILIES, STATE_FAMILIES
from tests.real_models.harness import (
    SENSITIVE,
    TOLERANCE,
    Case,
    Outcome,
    Zoo,
    make_case,
    run_embedded,
)

CASES = [
    make_case("p4_a14_extend", 4, 14, extend=5, hit=12),  # A off a page boundary
    make_case("p4_a16_extend", 4, 16, extend=5, hit=16),  # A on one
    make_case("p4_a16_diverge10", 4, 16, diverge_at=10, hit=8),  # B shares 10 tokens of A
    make_case("p4_a16_exact", 4, 16, exact=True, hit=12),  # B = A: lookup B[:15]
    make_case("p4_a13_exact", 4, 13, exact=True, hit=12),  # a one-token (decode) continuation
    make_case("p16_a40_extend", 16, 40, extend=5, hit=32),
    make_case("p16_a48_extend", 16, 48, extend=5, hit=48),
    make_case("p16_a48_diverge20", 16, 48, diverge_at=20, hit=16),
    make_case("p16_a48_exact", 16, 48, exact=True, hit=32),
]

# window 8: a hit of h pages needs the sliding pages holding tokens [h*P - 8, h*P)
SLIDING_FREED = [
    # the engine freed pages 0 and 1 (tokens 0..7) of A before storing
    make_case("p4_a24_freed01_extend", 4, 24, extend=4, hit=24, freed={"sliding": (0, 1)}),
    make_case("p4_a24_freed01_diverge21", 4, 24, diverge_at=21, hit=20, freed={"sliding": (0, 1)}),
    # every hit of this B (12 tokens and less) needs page 0 or 1: nothing hits
    make_case("p4_a24_freed01_diverge13", 4, 24, diverge_at=13, hit=0, freed={"sliding": (0, 1)}),
    # page 2 freed: 16 and 12 tokens need it, 8 does not
    make_case("p4_a24_freed2_diverge17", 4, 24, diverge_at=17, hit=8, freed={"sliding": (2,)}),
    make_case("p16_a48_freed0_diverge40", 16, 48, diverge_at=40, hit=32, freed={"sliding": (0,)}),
    make_case("p16_a48_freed0_diverge20", 16, 48, diverge_at=20, hit=0, freed={"sliding": (0,)}),
]

# chunk 8: a hit of h*P tokens needs the chunked pages of its current chunk only
ALL_SIX = (0, 1, 2, 3, 4, 5)
CHUNKED_FREED = [
    # at 24 tokens the current chunk is empty: the engine holds no chunked page at all
    make_case("p4_a24_chunkfreed_extend", 4, 24, extend=4, hit=24, freed={"chunked": ALL_SIX}),
    # 20 tokens need page 4 (tokens 16..19), freed: the hit falls back to 16 (a chunk start)
    make_case(
        "p4_a24_chunkfreed_diverge21", 4, 24, diverge_at=21, hit=16, freed={"chunked": ALL_SIX}
    ),
    make_case(
        "p4_a24_chunkfreed0123_diverge21",
        4,
        24,
        diverge_at=21,
        hit=20,
        freed={"chunked": (0, 1, 2, 3)},
    ),
]


def check(out: Outcome) -> None:
    case = out.case
    assert out.lookup_tokens_total == case.expect_hit, out.message()
    assert out.lookup_tokens_l2 == case.expect_hit, out.message()
    assert out.loaded_tokens == case.expect_hit, out.message()
    if case.expect_hit == 0:
        assert out.diff is None, out.message()
        return
    assert out.diff is not None, out.message()
    assert out.diff <= TOLERANCE, out.message()


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("family", list(FAMILIES))
async def test_model_continues_from_hicache_as_from_its_own_cache(
    zoo: Zoo, family: str, case: Case
) -> None:
    check(await run_embedded(zoo.get(family), case))


@pytest.mark.asyncio
@pytest.mark.parametrize("case", SLIDING_FREED, ids=str)
@pytest.mark.parametrize("family", SLIDING_FAMILIES)
async def test_freed_sliding_pages_shorten_the_hit_never_corrupt_it(
    zoo: Zoo, family: str, case: Case
) -> None:
    check(await run_embedded(zoo.get(family), case))


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CHUNKED_FREED, ids=str)
async def test_freed_chunked_pages_shorten_the_hit_never_corrupt_it(zoo: Zoo, case: Case) -> None:
    check(await run_embedded(zoo.get("llama4_text"), case))


@pytest.mark.asyncio
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize(
    "family", ["llama", "gemma3_text", "llama4_text", "qwen3_next", "falcon_h1", "deepseek_v32"]
)
async def test_loaded_from_l3_after_l2_is_emptied(
    zoo: Zoo, family: str, layout: str, tmp_path: Path
) -> None:
    case = make_case("p4_a16_diverge10", 4, 16, diverge_at=10, hit=8)
    out = await run_embedded(zoo.get(family), case, l3_dir=tmp_path / "l3", host_layout=layout)
    assert out.lookup_tokens_l2 == 0, out.message()  # L2 was emptied: the hit is L3's
    assert out.lookup_tokens_total == case.expect_hit, out.message()
    assert out.loaded_tokens == case.expect_hit, out.message()
    assert out.diff is not None, out.message()
    assert out.diff <= TOLERANCE, out.message()


TURNS = [
    # a conversation: A[:16] stored first, then A (24 tokens): the second store adds only pages
    # 4 and 5 and the snapshots after 20 and 24 tokens
    make_case("p4_turns16_a24_extend", 4, 24, extend=4, hit=24, earlier=(16,)),
    make_case("p4_turns16_a24_diverge10", 4, 24, diverge_at=10, hit=8, earlier=(16,)),
    make_case("p16_turns16_a48_diverge40", 16, 48, diverge_at=40, hit=32, earlier=(16,)),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("case", TURNS, ids=str)
@pytest.mark.parametrize("family", list(FAMILIES))
async def test_a_prompt_stored_turn_by_turn_is_served_whole(
    zoo: Zoo, family: str, case: Case
) -> None:
    """Each store backs up only what the index lacks (every page and snapshot once), and a
    hit spans pages of both turns."""
    tm = zoo.get(family)
    out = await run_embedded(tm, case)
    check(out)
    assert out.pages_stored == len(case.a) // case.page * len(tm.groups()), out.message()


@pytest.mark.asyncio
@pytest.mark.parametrize("family", list(FAMILIES))
async def test_pages_the_engine_still_holds_are_skipped(zoo: Zoo, family: str) -> None:
    """`skip_pages=2`: the engine's own copy of pages 0 and 1 stays in its pool; hicache loads
    the rest (and the snapshot), and the model continues as from its own cache."""
    case = make_case("p4_a16_extend", 4, 16, extend=5, hit=16)
    check(await run_embedded(zoo.get(family), case, skip_pages=2))


# ---- defect detectors: the comparison can fail ---------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("family", STATE_FAMILIES)
async def test_a_snapshot_filed_under_the_wrong_length_is_caught(zoo: Zoo, family: str) -> None:
    """The old bug: the state after 14 tokens (A's end) filed as the snapshot for 12. B = A + new
    hits 12 tokens and continues from a state two tokens ahead: the logits move by more than
    SENSITIVE. Filed right (the state after exactly 12), the same prompt matches."""
    tm = zoo.get(family)
    wrong = make_case("p4_a14_label", 4, 14, extend=5, hit=12, snapshot_of={12: 14})
    bad = await run_embedded(tm, wrong)
    assert bad.loaded_tokens == 12, bad.message()
    assert bad.diff is not None, bad.message()
    assert bad.diff > SENSITIVE, bad.message()
    right = make_case("p4_a14_label", 4, 14, extend=5, hit=12)
    assert right.a == wrong.a
    good = await run_embedded(tm, right)
    check(good)


@pytest.mark.asyncio
@pytest.mark.parametrize("family", list(FAMILIES))
async def test_a_page_read_in_anothers_place_is_caught(zoo: Zoo, family: str) -> None:
    """After a correct load, every token group's page 2 read in page 3's place as well (page
    3's bytes lost to page 2's, as a load into the wrong device page would leave them): the
    logits move by more than SENSITIVE. The NaN fill alone would not notice."""
    case = make_case("p4_a16_extend", 4, 16, extend=5, hit=16)
    out = await run_embedded(zoo.get(family), case, misplace=(2, 3))
    assert out.loaded_tokens == 16, out.message()
    assert out.diff is not None, out.message()
    assert out.diff > SENSITIVE, out.message()


@pytest.mark.asyncio
@pytest.mark.parametrize("label", [14, 16, 0])
async def test_a_snapshot_off_a_page_boundary_or_past_the_prompt_is_refused(
    zoo: Zoo, label: int
) -> None:
    """A 14-token prompt at P=4 can file snapshots for 4, 8 and 12 tokens only: 14 (not a page
    boundary), 16 (past the prompt) and 0 are refused with the group and the length named."""

    tm = zoo.get("qwen3_next")
    embedded = by_key.embedded(
        tm.layer_map,
        dtype=torch.float32,
        page_size_tokens=4,
        host_capacity_bytes=8 << 20,
        device_pages={"full": 8, "linear": 4},
    )
    cache = by_key.tiered(embedded)
    try:
        async with cache.running():
            tokens = list(range(1, 15))
            with pytest.raises(OpRequestError, match=rf"linear.*\b{label}\b"):
                await cache.store(tokens, {"full": [0, 1, 2]}, snapshots={"linear": {label: 0}})
            assert cache.lookup(tokens).tokens_total == 0  # nothing was stored
    finally:
        embedded.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("family", STATE_FAMILIES)
async def test_a_store_without_snapshots_gives_a_state_model_no_hit(zoo: Zoo, family: str) -> None:
    """Token pages alone cannot serve a state model: without a snapshot nothing hits (the old
    API filed the engine's one state slot under the prompt's last full page, whatever length
    it held)."""

    tm = zoo.get(family)
    embedded = by_key.embedded(
        tm.layer_map,
        dtype=torch.float32,
        page_size_tokens=4,
        host_capacity_bytes=8 << 20,
        device_pages={g.name: 8 if g.kind.is_token_cache else 4 for g in tm.groups()},
    )
    cache = by_key.tiered(embedded)
    try:
        async with cache.running():
            tokens = list(range(1, 15))
            pages = {g.name: [0, 1, 2] for g in tm.groups() if g.kind.is_token_cache}
            stored = await cache.store(tokens, pages)
            assert stored.pages_stored == 3 * len(pages)  # the token pages went in
            assert cache.lookup(tokens).tokens_total == 0
    finally:
        embedded.close()
