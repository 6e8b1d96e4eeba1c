"""The two contracts that make hybrid hits right, at the tiered cache: a state snapshot is
filed under exactly the prefix length the engine says it covers (several per prompt), and a
token page the engine no longer holds is never stored, so a window that needs it never hits.
Byte-level here; tests/real_models proves the same with real model math."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache.cache import TieredCache
from hicache.scheduler import OpRequestError
from tests.test_tiered import build, snapshot, wipe

PAGE = 4


def fill_slot(cache: TieredCache, group: str, slot: int, value: float) -> None:
    for layer in cache.embedded.device_pools[group].tensors:
        for t in layer.values():
            t[slot].fill_(value)


def slot_value(cache: TieredCache, group: str, slot: int) -> float:
    t = next(iter(cache.embedded.device_pools[group].tensors[0].values()))
    return float(t[slot].flatten()[0])


@pytest.mark.asyncio
async def test_a_snapshot_is_filed_under_the_length_it_covers(tmp_path: Path) -> None:
    """14 tokens at P=4: the state after 14 tokens cannot be keyed (refused); the states
    after 4, 8 and 12 tokens are filed under exactly those prefixes, so a prompt sharing only
    two pages, and an exact repeat looked up without its last token, both hit."""
    cache, _ = build(tmp_path, "qwen3_next_80b.json", host_pages=16)
    try:
        async with cache.running():
            tokens = list(range(14))
            full = {"full": [0, 1, 2]}
            with pytest.raises(
                OpRequestError,
                match=r"^snapshots\.linear: a snapshot after 14 tokens cannot be keyed; allowed: a multiple of the page size \(4\) in 4\.\.12 \(the prompt's full pages\)$",
            ):
                await cache.store(tokens, full, snapshots={"linear": {14: 0}})
            with pytest.raises(
                OpRequestError,
                match=r"^device_pages\.linear: 'linear' is a linear-attention state group; a store gives its snapshots as snapshots=\{group: \{num_tokens: slot\}\}, saying how many tokens each snapshot covers$",
            ):
                await cache.store(tokens, {**full, "linear": [0]})
            assert cache.lookup(tokens).pages_total == 0  # nothing was stored by the refusals
            assert all(cache.index.l2_pages(g) == 0 for g in cache.index.rules)
            for slot, value in enumerate((4.0, 8.0, 12.0)):
                fill_slot(cache, "linear", slot, value)
            stored = await cache.store(tokens, full, snapshots={"linear": {4: 0, 8: 1, 12: 2}})
            assert stored.pages_stored == 3 + 3
            assert cache.lookup(tokens).tokens_l2 == 12
            # a prompt sharing two pages, then diverging: the 8-token snapshot serves it
            other = [*tokens[:8], 99, 98, 97, 96, 95]
            assert cache.lookup(other).tokens_l2 == 8
            wipe(cache)
            handle, hit = await cache.load(other, {"full": [4, 5, 6], "linear": [3]})
            assert handle is not None
            assert hit.tokens_total == 8
            assert (await handle.done()).ok
            assert slot_value(cache, "linear", 3) == 8.0
            # an exact repeat of a 12-token prompt: the engine computes its last token, so it
            # asks for 11, and the 8-token snapshot serves
            assert cache.lookup(tokens[:12]).tokens_l2 == 12
            assert cache.lookup(tokens[:11]).tokens_l2 == 8
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_a_wrong_snapshot_cannot_stick(tmp_path: Path) -> None:
    """The old bug: the state after 14 tokens was filed under 12 and, the key being known, a
    later store of the right state stored nothing. A store now says each length; the only
    snapshot under 12 is the one the engine says is the state after 12 tokens."""
    cache, _ = build(tmp_path, "qwen3_next_80b.json", host_pages=16)
    try:
        async with cache.running():
            tokens = list(range(14))
            fill_slot(cache, "linear", 0, 12.0)
            await cache.store(tokens, {"full": [0, 1, 2]}, snapshots={"linear": {12: 0}})
            wipe(cache)
            handle, hit = await cache.load(tokens, {"full": [4, 5, 6], "linear": [1]})
            assert handle is not None
            assert (await handle.done()).ok
            assert hit.tokens_total == 12
            assert slot_value(cache, "linear", 1) == 12.0
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_pages_the_engine_freed_are_never_stored_or_served(tmp_path: Path) -> None:
    """gpt-oss slides over 128 tokens. An engine that freed a sliding page (None) stores the
    rest; a prefix whose window needs the freed page does not hit (never another request's
    bytes), a longer one whose window has moved past it does."""
    cache, _ = build(tmp_path, "gpt_oss_20b.json", host_pages=80, device_token_pages=80)
    try:
        async with cache.running():
            tokens = list(range(40 * PAGE))  # 160 tokens, 40 pages
            full = list(range(40))
            sliding: list[int | None] = list(range(40))
            sliding[2] = None  # freed: outside the window of the prompt's last token
            want = snapshot(cache, {"sliding": [p for p in sliding if p is not None]})
            stored = await cache.store(tokens, {"full": full, "sliding": sliding})
            assert stored.pages_stored == 40 + 39
            keys = cache.index.keys(tokens)
            assert cache.index.record("sliding", keys["sliding"][2]) is None
            # a 12-page (48-token) prefix needs sliding pages 0..11, page 2 among them
            assert cache.lookup(tokens[: 12 * PAGE]).tokens_l2 == 2 * PAGE
            # 35 pages (140 tokens) need tokens 12..139: pages 3..34, all held
            assert cache.lookup(tokens[: 35 * PAGE]).tokens_l2 == 35 * PAGE
            wipe(cache)
            dst = list(range(40, 75))
            handle, hit = await cache.load(tokens[: 35 * PAGE], {"full": dst, "sliding": dst})
            assert handle is not None
            assert (await handle.done()).ok
            assert [i for i, _ in hit.needed["sliding"]] == list(range(3, 35))
            got = snapshot(cache, {"sliding": dst})
            for (group, local, t, i), value in got.items():
                if 3 <= i < 35:
                    src_index = i - (i > 2)  # `want` skipped the freed page
                    assert torch.equal(value, want[(group, local, t, src_index)])
    finally:
        cache.embedded.close()
