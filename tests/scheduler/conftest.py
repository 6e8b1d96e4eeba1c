"""Builders for scheduler tests: a small embedded stack on a real layout."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from hicache.assembly import by_key
from hicache.embedded import EmbeddedCache
from hicache.memory import GroupGeometry
from hicache.model import LayerMap, load_layout
from hicache.scheduler import GroupPages
from hicache.testing.fake_copies import FakeCopyBackend
from hicache.transfer import CopyBackend
from tests.conftest import shared_model

PAGE = 2


@contextmanager
def stack(
    model: str,
    *,
    backend: CopyBackend | None = None,
    host_pages: int = 6,
    token_pages: int = 8,
    state_pages: int = 3,
    start: int = 0,
    end: int | None = None,
    **kwargs: Any,
) -> Iterator[EmbeddedCache]:
    layer_map = LayerMap(load_layout(shared_model(model)), start, end)
    geoms = [GroupGeometry(g, torch.float16, PAGE) for g in layer_map.groups]
    per_page = sum(g.page_bytes for g in geoms)
    device_pages = {
        g.name: token_pages if g.group.kind.is_token_cache else state_pages for g in geoms
    }
    cache = by_key.embedded(
        layer_map,
        dtype=torch.float16,
        page_size_tokens=PAGE,
        host_capacity_bytes=host_pages * per_page,
        host_pages_per_group={g.name: host_pages for g in geoms},
        device_pages=device_pages,
        backend=backend,
        **kwargs,
    )
    gen = torch.Generator().manual_seed(0)
    for pool in cache.device_pools.values():
        for layer in pool.tensors:
            for t in layer.values():
                t.view(-1).view(torch.uint8).copy_(
                    torch.randint(0, 256, (t.numel() * 2,), dtype=torch.uint8, generator=gen)
                )
    try:
        yield cache
    finally:
        cache.close()


@contextmanager
def gate_opened_on_exit(backend: FakeCopyBackend) -> Iterator[FakeCopyBackend]:
    """A failing assertion must not leave copies held at the gate: the scheduler's clean
    shutdown waits for in-flight walks, so open the gate first."""
    try:
        yield backend
    finally:
        backend.open_gate()


def pages_for(
    cache: EmbeddedCache, token_pages: list[int], state_page: int
) -> dict[str, GroupPages]:
    """One request's device pages in every group (token groups get the list, state groups
    one snapshot slot)."""
    out = {}
    for name, geom in cache.geometries.items():
        if geom.group.kind.is_token_cache:
            out[name] = GroupPages(tuple(token_pages))
        else:
            out[name] = GroupPages((state_page,))
    return out


def snapshot_pages(
    cache: EmbeddedCache, pages: Mapping[str, GroupPages]
) -> dict[tuple[str, int, str, int], torch.Tensor]:
    out = {}
    for name, gp in pages.items():
        pool = cache.device_pools[name]
        for local_id in range(pool.geometry.num_layers):
            for tensor, _ in pool.geometry.tensors:
                rows = pool.rows(local_id, tensor)
                for i, page in enumerate(gp.device_pages):
                    out[(name, local_id, tensor, i)] = rows[page].clone()
    return out


def assert_pinned_none(cache: EmbeddedCache) -> None:
    for pool in cache.host_tier.pools.values():
        assert pool.allocator.stats().pinned_pages == 0
        pool.allocator.check()
