"""A small embedded engine for the L3 fault tests: a dense model's tiered cache on CPU, and
`Engine`, which stores prompts from device pages 0.., loads them into the next pages and
checks every loaded page's bytes (a page not loaded is poisoned first, so a wrong or missing
copy fails its check). Misses are fine; wrong bytes never are."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from hicache.assembly import by_key
from hicache.cache import TieredCache
from hicache.demo.content import check_page, fill_page, prefix_seed
from hicache.memory import GroupGeometry
from hicache.model import LayerMap, load_layout
from hicache.storage import GuardedStore
from tests.conftest import shared_model


def dense_cache(store: GuardedStore, page: int, prompt_pages: int) -> TieredCache:
    """Qwen2-7B's layout (one full-attention group): L2 for two prompts, L1 for a store's and
    a load's pages; loads wait for L3 (`wait_complete`), so a hit is a hit."""
    layer_map = LayerMap(load_layout(shared_model("qwen2_7b.json")))
    geoms = [GroupGeometry(g, torch.float16, page) for g in layer_map.groups]
    embedded = by_key.embedded(
        layer_map,
        dtype=torch.float16,
        page_size_tokens=page,
        host_capacity_bytes=2 * prompt_pages * sum(g.page_bytes for g in geoms),
        device_pages={g.name: 2 * prompt_pages for g in geoms},
    )
    return by_key.tiered(embedded, store=store, prefetch_policy="wait_complete")


class Engine:
    def __init__(self, cache: TieredCache, page: int, prompt_pages: int):
        self.cache = cache
        self.page, self.prompt_pages = page, prompt_pages
        (self.group,) = cache.index.rules
        self.pool = cache.embedded.device_pools[self.group]

    async def store(self, tokens: list[int]) -> None:
        pages = list(range(self.prompt_pages))
        for i, page in enumerate(pages):
            fill_page(self.pool, page, prefix_seed(tokens, (i + 1) * self.page, self.group))
        await self.cache.store(tokens, {self.group: pages})

    async def load(self, tokens: list[int]) -> int:
        """Pages loaded (all verified)."""
        pages = list(range(self.prompt_pages, 2 * self.prompt_pages))
        for page in pages:  # poison: a page not loaded fails its check
            fill_page(self.pool, page, 0xDEAD)
        hit = self.cache.lookup(tokens)
        if self.cache.needs_discovery(tokens, hit):
            await self.cache.discover(tokens)
        handle, hit = await self.cache.load(tokens, {self.group: pages})
        if handle is None:
            return 0
        assert (await handle.done()).ok
        for i, _ in hit.needed[self.group]:
            seed = prefix_seed(tokens, (i + 1) * self.page, self.group)
            assert check_page(self.pool, pages[i], seed), (tokens[0], i)  # never wrong bytes
        return len(hit.needed[self.group])

    async def round(self, prompts: Sequence[list[int]]) -> tuple[float, float]:
        """Load every prompt (from L3: L2 is cleared first), then store it again as an engine
        would after its prefill; returns (hit rate, mean seconds per load)."""
        self.cache.clear_l2()
        loaded, spent = 0, 0.0
        for tokens in prompts:
            started = time.perf_counter()
            loaded += await self.load(tokens)
            spent += time.perf_counter() - started
            await self.store(tokens)
        await self.cache.persist.idle()
        return loaded / (len(prompts) * self.prompt_pages), spent / len(prompts)
