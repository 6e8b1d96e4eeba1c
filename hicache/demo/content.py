"""What a synthetic "prefill" writes: KV bytes derived from the token ids alone, so any process
can check a loaded page without having seen it stored.

A token-cache page's bytes are a function of the token prefix up to the end of that page (the
same prefix always gives the same KV, as in a real model); a state group's snapshot is a
function of the whole prefix it summarises. Each (group, layer, tensor) row gets its own slice
of one seeded stream per page.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from hicache.memory import DevicePool


def prefix_seed(tokens: Sequence[int], upto: int, group: str) -> int:
    data = np.asarray(tokens[:upto], dtype=np.uint32).tobytes()
    return int(xxhash.xxh64_intdigest(data, seed=len(group) * 7919 + sum(map(ord, group))))


def page_bytes(pool: DevicePool, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(pool.geometry.page_bytes)


def _rows(pool: DevicePool, page: int) -> list[np.ndarray]:
    return [
        rows[page].numpy()
        for local_id in range(pool.geometry.num_layers)
        for rows in pool.layer_rows(local_id)
    ]


def fill_page(pool: DevicePool, page: int, seed: int) -> None:
    data = np.frombuffer(page_bytes(pool, seed), dtype=np.uint8)
    offset = 0
    for row in _rows(pool, page):
        row[:] = data[offset : offset + row.size]
        offset += row.size


def check_page(pool: DevicePool, page: int, seed: int) -> bool:
    data = np.frombuffer(page_bytes(pool, seed), dtype=np.uint8)
    offset = 0
    for row in _rows(pool, page):
        if not np.array_equal(row, data[offset : offset + row.size]):
            return False
        offset += row.size
    return True


def seeds_for(
    tokens: Sequence[int], group: str, is_token_cache: bool, page_size_tokens: int
) -> list[int]:
    """Per page position of the prompt (token groups), or the one snapshot (state groups)."""
    full_pages = len(tokens) // page_size_tokens
    if is_token_cache:
        return [prefix_seed(tokens, (i + 1) * page_size_tokens, group) for i in range(full_pages)]
    return [prefix_seed(tokens, full_pages * page_size_tokens, group)]
