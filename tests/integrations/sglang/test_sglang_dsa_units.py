"""The SGLang backend's DSA parts that need no SGLang (they run in the main environment): how
SGLang's `DSAIndexerPoolHost` maps onto the index rows of the tiny DeepSeek-V3.2's sparse group
beside its MLA latents (`index_pools`: checked byte for byte on buffers laid out as SGLang lays
them out, every mismatch named)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.channel.shm import map_pools
from hicache.config import load_deployment
from hicache.integrations.core.shared_memory import share_in_place
from hicache.integrations.sglang.host_pools import HostKv, host_pool_manifest, kv_group
from hicache.integrations.sglang.index_pools import (
    HostIndex,
    IndexPoolError,
    LastKvLoads,
    check_index,
    index_rows,
    needs_index,
)
from hicache.memory import CacheDtypes, GroupGeometry, group_geometries
from tests.integrations.sglang.dsa_driver import INDEX_PAGE, LATENT, L, P
from tests.integrations.sglang.dsa_harness import write_dsa_deployment
from tests.integrations.sglang.test_sglang_v2_units import shared_buffer

PAGES, INDEX_PAGES = 5, 7  # SGLang's indexer buffer has a page or two more than the KV's
KEYS = P * 128  # a page's fp8 keys, before its float32 scales


def geometries(tmp_path: Path, index_format: str = "fp8_scaled") -> dict[str, GroupGeometry]:
    loaded = load_deployment(write_dsa_deployment(tmp_path, index_format))
    return group_geometries(
        loaded.layer_map().groups, CacheDtypes.from_names("bfloat16", None, None), P
    )


class MLATokenToKVPoolHost:  # what the mapping reads of SGLang's class of this name
    def __init__(self, layout: str, kv_buffer: torch.Tensor):
        self.layout, self.kv_buffer = layout, kv_buffer
        self.layer_num = self.target_layer_num = L
        self.page_size, self.size, self.kv_cache_dim = P, PAGES * P, LATENT
        self.dtype = torch.bfloat16
        self._native_buffers, self.dsa_kv_cache_store_fp8 = None, False


class DSAIndexerPoolHost:  # what the mapping reads of SGLang's class of this name
    def __init__(self, kind: str, buffer: torch.Tensor | None, **over: Any):
        self.layout, self.index_k_with_scale_buffer = kind, buffer
        self.layer_num = self.target_layer_num = L
        self._live_target_layers = list(range(L))
        self.page_size, self.indexer_page_stride_size = P, INDEX_PAGE
        vars(self).update(over)


def latent_buffer(layout: str) -> torch.Tensor:
    shape = {
        "layer_first": (L, PAGES * P, 1, LATENT),
        "page_first_direct": (PAGES, L, P, 1, LATENT),
    }[layout]
    return shared_buffer(shape, torch.bfloat16, 3)


def index_buffer(layout: str) -> torch.Tensor:
    """As `DSAIndexerPoolHost.init_kv_buffer` shapes it in `layout` (uint8)."""
    shape = {
        "layer_first": (L, INDEX_PAGES, INDEX_PAGE),
        "page_first_direct": (INDEX_PAGES, L, 1, INDEX_PAGE),
    }[layout]
    return shared_buffer(shape, torch.uint8, 5)


def latent_page(buffer: torch.Tensor, layout: str, layer: int, page: int) -> bytes:
    rows = (
        buffer[layer, page * P : (page + 1) * P] if layout == "layer_first" else buffer[page, layer]
    )
    return bytes(rows.contiguous().view(torch.uint8).view(-1).tolist())


def sglang_index_page(buffer: torch.Tensor, layout: str, layer: int, page: int) -> bytes:
    """Host page `page` of `layer` as SGLang's own `get_data_page` indexing reads it."""
    row = buffer[layer, page] if layout == "layer_first" else buffer[page, layer, 0]
    return bytes(row.tolist())


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_the_sidecar_sees_sglang_s_index_pages_as_the_sparse_group_s_index_rows(
    tmp_path: Path, layout: str
) -> None:
    keys = index_buffer(layout)  # mapped first: mostly above the latents, so the region's last
    latents = latent_buffer(layout)
    host = HostKv.of(MLATokenToKVPoolHost(layout, latents))
    geoms = geometries(tmp_path)
    group = kv_group(host, geoms, P)
    assert group == "sparse"
    assert needs_index(geoms, group)
    index = HostIndex.of(DSAIndexerPoolHost(layout, keys), host)
    assert (index.pages, index.page_bytes) == (INDEX_PAGES, INDEX_PAGE)
    check_index(index, group, geoms[group])
    whole = latents.untyped_storage()
    # the indexer buffer keeps INDEX_PAGES pages, the KV pool PAGES: only the rows of the KV
    # pool's pages are shared, so the memfd ends where the rows do (the sidecar's "no slack")
    region = share_in_place(
        [whole, keys.untyped_storage()],
        "the test's DSA host pools",
        reach=[(whole.data_ptr(), whole.data_ptr() + whole.nbytes()), index.reach(PAGES)],
    )
    try:
        rows = index_rows(region, index, geoms[group])
        pools = host_pool_manifest(region, latents, host, group, geoms[group], None, rows)
        # the sidecar's own checks and mapping of the manifest
        mapped, memory = map_pools(pools.manifest(), {group: geoms[group]}, os.getpid())
        views = mapped[group].tensors
        for layer in range(L):
            assert list(views[layer]) == ["kv", "index_k", "index_k_scale"]
            for page in range(PAGES):  # the KV pool's pages: the group's pages
                want = sglang_index_page(keys, layout, layer, page)
                assert bytes(views[layer]["index_k"][page].tolist()) == want[:KEYS]
                assert bytes(views[layer]["index_k_scale"][page].tolist()) == want[KEYS:]
                assert bytes(views[layer]["kv"][page].tolist()) == latent_page(
                    latents, layout, layer, page
                )
        del views, mapped, memory
        pools.close()
    finally:
        region.close()


def test_an_index_in_the_kv_dtype_is_refused_naming_the_setting(tmp_path: Path) -> None:
    geoms = geometries(tmp_path, "kv_dtype")
    host = HostKv.of(MLATokenToKVPoolHost("layer_first", latent_buffer("layer_first")))
    group = kv_group(host, geoms, P)  # the latent alone still fits the KV pool
    index = HostIndex.of(DSAIndexerPoolHost("layer_first", index_buffer("layer_first")), host)
    with pytest.raises(IndexPoolError) as err:
        check_index(index, group, geoms[group])
    assert str(err.value) == (
        "the sidecar's group 'sparse' keeps index tensors ['index_k']; SGLang keeps DSA index "
        "keys as fp8 with a float32 scale per 128 dims (132 bytes a token): set "
        "model.index_format: fp8_scaled in the deployment"
    )


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"layout": "page_first_direct"}, "pool is page_first_direct, its KV host pool layer_"),
        ({"layer_num": L + 1}, "holds 1 MTP draft layers; hicache maps one row"),
        ({"_live_target_layers": [0]}, "holds keys for layers [0] of the KV pool's 2"),
        ({"index_k_with_scale_buffer": None}, "holds no host buffer (allocator-only)"),
    ],
)
def test_indexer_pools_hicache_does_not_map_are_refused_by_name(
    over: dict[str, Any], why: str
) -> None:
    host = HostKv.of(MLATokenToKVPoolHost("layer_first", latent_buffer("layer_first")))
    pool = DSAIndexerPoolHost("layer_first", index_buffer("layer_first"), **over)
    with pytest.raises(IndexPoolError, match=r"SGLang's .*indexer host pool") as err:
        HostIndex.of(pool, host)
    assert why in str(err.value)


def test_another_indexer_pool_class_or_a_page_of_other_bytes_is_refused(tmp_path: Path) -> None:
    host = HostKv.of(MLATokenToKVPoolHost("layer_first", latent_buffer("layer_first")))

    class QSAIndexerPoolHost(DSAIndexerPoolHost):
        pass

    with pytest.raises(IndexPoolError, match="is a QSAIndexerPoolHost; hicache maps DSA"):
        HostIndex.of(QSAIndexerPoolHost("layer_first", index_buffer("layer_first")), host)
    geoms = geometries(tmp_path)
    narrow = DSAIndexerPoolHost("layer_first", index_buffer("layer_first"))
    narrow.indexer_page_stride_size = P * 128  # keys without their scales
    with pytest.raises(IndexPoolError) as err:
        check_index(HostIndex.of(narrow, host), "sparse", geoms["sparse"])
    assert "a layer's page: SGLang 8192 bytes of keys and scales, sidecar 8192 + 256 bytes" in str(
        err.value
    )


def test_the_last_kv_load_answers_only_the_next_indexer_call_of_its_thread_and_batch() -> None:
    """Every ordering of a thread's KV loads and indexer calls: answered only by the record of
    the same thread, keys and pages, and only once."""
    loads = LastKvLoads()
    keys, pages = ["k1", "k2"], [3, 4]
    assert loads.take(keys, pages) is None  # nothing recorded: the indexer loads for itself
    loads.record(keys, pages, 2)
    assert loads.take(keys, pages) == 2  # right after the KV load of the same batch
    assert loads.take(keys, pages) is None  # taken once
    loads.record(keys, pages, 1)  # a KV load that moved one page of two
    assert loads.take(keys, pages) == 1
    loads.record(keys, pages, 2)
    assert loads.take(keys, [3, 5]) is None  # other host pages: loads for itself...
    assert loads.take(keys, pages) is None  # ...and the record is gone
    loads.record(keys, pages, 2)
    loads.record(["k9"], [7], 0)  # the next KV load replaces it
    assert loads.take(keys, pages) is None
    loads.record(keys, pages, 2)
    assert loads.take(keys, None) is None  # indices that are not whole pages
    loads.record(keys, pages, 2)
    seen: list[int | None] = []
    other = threading.Thread(target=lambda: seen.append(loads.take(keys, pages)))
    other.start()
    other.join()
    assert seen == [None]  # another controller thread never takes this thread's record
    assert loads.take(keys, pages) == 2
