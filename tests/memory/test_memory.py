"""Page allocator (properties), device-pool wrapping errors, host-tier sizing and layouts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.errors import ConfigError, PinError, PoolExhaustedError, PoolShapeError
from hicache.memory import DevicePool, GroupGeometry, HostPool, HostTier, PageAllocator
from hicache.memory.host_tier import budget_pages
from hicache.model import CacheGroup, CacheKind, CacheSpec, KvFormat, LayerMap, load_layout
from tests.conftest import shared_model

MHA = CacheSpec(CacheKind.FULL, KvFormat.MHA, num_kv_heads=2, head_dim=8, v_head_dim=8)


def geometry(
    spec: CacheSpec = MHA, layers: tuple[int, ...] = (0, 1), page: int = 4
) -> GroupGeometry:
    return GroupGeometry(CacheGroup("full", spec, layers), torch.bfloat16, page)


def test_geometry_bytes() -> None:
    g = geometry()
    assert g.row_bytes("k") == 4 * 2 * 8 * 2
    assert g.page_bytes_per_layer == 2 * 128
    assert g.page_bytes == 2 * 256
    state = geometry(CacheSpec(CacheKind.MAMBA, state_shapes=(("ssm", (3, 5)),)), page=16)
    assert state.slots_per_page == 1
    assert state.row_bytes("ssm") == 3 * 5 * 2


def test_allocator_prefers_runs_and_is_all_or_nothing() -> None:
    alloc = PageAllocator(10, "host pool 'full'")
    assert alloc.alloc(4) == [0, 1, 2, 3]
    alloc.free([1, 2])
    assert alloc.alloc(3) == [4, 5, 6]  # first run that fits, not the hole
    with pytest.raises(
        PoolExhaustedError,
        match=r"^host pool 'full': 6 pages asked for, 5 of 10 "
        r"free \(the others hold data or are pinned by copies in flight\); free or evict "
        r"pages, or raise the pool's capacity$",
    ):
        alloc.alloc(6)
    assert alloc.stats().free_pages == 5
    pages = alloc.alloc(5)
    assert sorted(pages) == [1, 2, 7, 8, 9]
    alloc.check()


def test_pins_block_free_and_messages() -> None:
    alloc = PageAllocator(4, "p")
    pages = alloc.alloc(2)
    alloc.pin(pages)
    alloc.pin([pages[0]])
    with pytest.raises(
        PinError, match=r"^p: page 0 is pinned \(2 in flight\); unpin it before freeing$"
    ):
        alloc.free(pages)
    assert alloc.stats().free_pages == 2  # the failed free changed nothing
    alloc.unpin(pages)
    with pytest.raises(PinError, match=r"^p: page 1 is not pinned; unpin without a pin$"):
        alloc.unpin([1])
    alloc.unpin([0])
    alloc.free(pages)
    with pytest.raises(PinError, match=r"^p: page 0 is not allocated; it cannot be freed$"):
        alloc.free([0])
    with pytest.raises(PinError, match=r"^p: page 3 is not allocated; it cannot be pinned$"):
        alloc.pin([3])
    alloc.check()


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "free", "pin", "unpin"]), st.integers(0, 12)),
        max_size=60,
    )
)
def test_allocator_invariants_under_any_sequence(ops: list[tuple[str, int]]) -> None:
    alloc = PageAllocator(16)
    held: list[int] = []
    pinned: list[int] = []
    for op, n in ops:
        if op == "alloc":
            try:
                got = alloc.alloc(n)
            except PoolExhaustedError:
                assert n > 16 - len(held)
                continue
            assert len(got) == n
            assert not set(got) & set(held)
            held.extend(got)
        elif op == "free" and held:
            page = held[n % len(held)]
            if page in pinned:
                with pytest.raises(PinError):
                    alloc.free([page])
            else:
                alloc.free([page])
                held.remove(page)
        elif op == "pin" and held:
            page = held[n % len(held)]
            alloc.pin([page])
            pinned.append(page)
        elif op == "unpin" and pinned:
            page = pinned.pop(n % len(pinned))
            alloc.unpin([page])
        alloc.check()
        assert alloc.stats().free_pages == 16 - len(held)
        assert alloc.stats().pinned_pages == len(set(pinned))


def test_device_pool_wrap_errors_name_the_tensor() -> None:
    g = geometry()
    good = [
        {
            "k": torch.zeros(8, 2, 8, dtype=torch.bfloat16),
            "v": torch.zeros(8, 2, 8, dtype=torch.bfloat16),
        }
        for _ in range(2)
    ]
    assert DevicePool(g, good).num_pages == 2
    bad_shape = [good[0], {"k": torch.zeros(8, 2, 4, dtype=torch.bfloat16), "v": good[1]["v"]}]
    with pytest.raises(
        PoolShapeError,
        match=r"^group 'full' layer 1 tensor 'k': shape \(8, 2, 4\); "
        r"expected \(8, 2, 8\)$",
    ):
        DevicePool(g, bad_shape)
    bad_dtype = [{"k": torch.zeros(8, 2, 8), "v": good[0]["v"]}, good[1]]
    with pytest.raises(
        PoolShapeError,
        match=r"^group 'full' layer 0 tensor 'k': dtype torch\.float32; "
        r"expected torch\.bfloat16; model\.dtype sets the KV's, model\.state_dtype and "
        r"model\.ssm_state_dtype the states'$",
    ):
        DevicePool(g, bad_dtype)
    with pytest.raises(
        PoolShapeError,
        match=r"^group 'full' layer 0: tensors \['k'\] given; expected \['k', 'v'\]$",
    ):
        DevicePool(g, [{"k": good[0]["k"]}, good[1]])
    odd = [{n: torch.zeros(6, 2, 8, dtype=torch.bfloat16) for n in "kv"} for _ in range(2)]
    with pytest.raises(
        PoolShapeError,
        match=r"^group 'full': 6 slots is not a positive multiple of the "
        r"page size \(4 slots per page\)$",
    ):
        DevicePool(g, odd)
    with pytest.raises(
        PoolShapeError, match=r"^group 'full': 1 layers of tensors given; the group has 2"
    ):
        DevicePool(g, good[:1])
    strided = [
        {n: torch.zeros(8, 8, 2, dtype=torch.bfloat16).transpose(1, 2) for n in "kv"}
        for _ in range(2)
    ]
    with pytest.raises(PoolShapeError, match=r"not contiguous"):
        DevicePool(g, strided)


def test_host_layouts_place_the_same_rows_differently() -> None:
    g = geometry()
    lf = HostPool(g, 3, "layer_first", torch.zeros(3 * g.page_bytes, dtype=torch.uint8))
    pf = HostPool(g, 3, "page_first", torch.zeros(3 * g.page_bytes, dtype=torch.uint8))
    assert lf.rows(1, "v").is_contiguous()
    assert not pf.rows(1, "v").is_contiguous()
    pf.rows(1, "v")[2].fill_(7)
    record = pf.page_chunks(2)
    assert len(record) == 1
    assert record[0].numel() == g.page_bytes
    # page 2's record: layer 0 (k, v) then layer 1 (k, v); v of layer 1 is the last quarter
    assert int(record[0][-g.row_bytes("v") :].min()) == 7
    assert int(record[0][: -g.row_bytes("v")].max()) == 0
    assert len(lf.page_chunks(0)) == 4
    with pytest.raises(
        PoolShapeError, match=r"^host pool 'full': buffer of 10 torch\.uint8 elements; needs "
    ):
        HostPool(g, 3, "layer_first", torch.zeros(10, dtype=torch.uint8))


def test_host_tier_sizes_every_token_group_alike_within_budget() -> None:
    layer_map = LayerMap(load_layout(shared_model("gpt_oss_20b.json")))
    geometries = [GroupGeometry(grp, torch.bfloat16, 16) for grp in layer_map.groups]
    per_page = sum(g.page_bytes for g in geometries)
    tier = HostTier.create(
        geometries, 10 * per_page + 5, "page_first", lambda n: torch.zeros(n, dtype=torch.uint8)
    )
    assert tier.report.pages_per_group == {"full": 10, "sliding": 10}
    assert tier.nbytes == 10 * per_page <= tier.report.capacity_bytes
    assert {p.num_pages for p in tier.pools.values()} == {10}
    assert "pages per group: full 10, sliding 10" in tier.report.lines()[0]
    with pytest.raises(
        ConfigError,
        match=r"^host\.capacity_bytes 1KiB cannot hold one page of the token groups \(full, "
        r"sliding: 768KiB, 1KiB budgeted for them\); allowed: at least 768KiB$",
    ):
        HostTier.create(geometries, 1024, "page_first", lambda n: torch.zeros(n, dtype=torch.uint8))


def test_host_tier_budgets_state_groups_by_snapshots() -> None:
    """Qwen3-Next-80B at equal page counts spent 92 of 96 GiB on state snapshots; by need,
    the snapshots get `state_fraction` of the budget and the KV pages the rest."""
    layer_map = LayerMap(load_layout(shared_model("qwen3_next_80b.json")))
    geometries = [GroupGeometry(grp, torch.bfloat16, 16) for grp in layer_map.groups]
    by_name = {g.name: g for g in geometries}
    budget = 8 << 30
    counts = budget_pages(geometries, budget, 0.25)
    state_bytes = counts["linear"] * by_name["linear"].page_bytes
    token_bytes = counts["full"] * by_name["full"].page_bytes
    assert state_bytes <= budget * 0.25 < state_bytes + by_name["linear"].page_bytes
    assert token_bytes <= budget * 0.75 < token_bytes + by_name["full"].page_bytes
    assert counts["full"] > 50 * counts["linear"]  # KV pages far outnumber snapshots
    with pytest.raises(
        ConfigError,
        match=r"^host\.capacity_bytes 64MiB cannot hold one snapshot of the state groups "
        r"\(linear: .+, 16MiB budgeted for them\); allowed: at least .+ \(or a larger "
        r"host\.state_fraction\)$",
    ):
        budget_pages(geometries, 64 << 20, 0.25)
