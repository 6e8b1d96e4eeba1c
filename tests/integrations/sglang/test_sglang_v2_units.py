"""The SGLang backend's v2 parts that need no SGLang (they run in the main environment):
SGLang's hit policies over the lengths each group serves (`hit_policies`), and how SGLang's
Mamba host pool maps onto the sidecar's state group of a real Qwen3-Next layout (`side_pools`:
checked byte for byte on buffers laid out as `MambaPoolHost` lays them out, every mismatch
named), beside the KV host pool's one full-attention group."""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.config import load_deployment
from hicache.integrations.core.shared_memory import share_in_place
from hicache.integrations.sglang.hit_policies import (
    ALL_PAGES,
    TRAILING_PAGES,
    PoolAsk,
    Restorable,
    restorable,
)
from hicache.integrations.sglang.host_pools import HostKv, HostPoolError, kv_group
from hicache.integrations.sglang.side_pools import (
    HostState,
    SidePoolError,
    check_state,
    host_slots,
    sliding_group,
    state_group,
    state_rows,
    window_fits,
)
from hicache.memory import CacheDtypes, GroupGeometry, group_geometries
from tests.integrations.sglang.hybrid_harness import PAGE, write_hybrid_deployment

MAMBA = PoolAsk("mamba", TRAILING_PAGES, 1)
SLOTS, LAYERS, CONV, TEMPORAL = 5, 2, (256, 3), (4, 32, 32)  # the tiny Qwen3-Next's


@pytest.mark.parametrize(
    ("kv_pages", "asks", "held", "expected"),
    [
        # Mamba (a trailing window of 1): the lengths a state is stored after, within KV's run
        (8, [MAMBA], {"mamba": {4, 8}}, Restorable(8, {"kv": 8, "mamba": 8}, [4, 8])),
        (6, [MAMBA], {"mamba": {4, 8}}, Restorable(4, {"kv": 6, "mamba": 4}, [4])),
        (8, [MAMBA], {}, Restorable(0, {"kv": 8}, [])),
        (0, [MAMBA], {"mamba": {1}}, Restorable(0, {}, [])),
        # a window of 3 pages (SWA): pages p-3 .. p-1 all held
        (
            8,
            [PoolAsk("swa", TRAILING_PAGES, 3)],
            {"swa": {2, 3, 4, 6, 7, 8}},
            Restorable(8, {"kv": 8, "swa": 8}, [4, 8]),
        ),
        # a window at the start needs only the pages there are
        (
            2,
            [PoolAsk("swa", TRAILING_PAGES, 3)],
            {"swa": {1, 2}},
            Restorable(2, {"kv": 2, "swa": 2}, [1, 2]),
        ),
        # every page (DSA indexer) up to its own run, intersected with the state's lengths
        (
            6,
            [PoolAsk("indexer", ALL_PAGES), MAMBA],
            {"indexer": {1, 2, 3, 5}, "mamba": {2, 5}},
            Restorable(2, {"kv": 6, "indexer": 3, "mamba": 5}, [2]),
        ),
        # a policy not served: nothing restorable (never an error)
        (4, [PoolAsk("x", "block_groups")], {"x": {1, 2, 3, 4}}, Restorable(0, {"kv": 4}, [])),
    ],
)
def test_hit_policies_follow_sglang_s_rules(
    kv_pages: int, asks: list[PoolAsk], held: dict[str, set[int]], expected: Restorable
) -> None:
    assert restorable(kv_pages, asks, held) == expected


@pytest.mark.parametrize("seed", range(20))
def test_hit_policies_equal_their_definition_page_by_page(seed: int) -> None:
    """Random KV runs, pools and holdings against the rules written per page: page i of a pool
    is held when length i + 1 is; a trailing window W allows p when pages p-W .. p-1 are held,
    ALL_PAGES when pages 0 .. p-1 are."""
    rng = random.Random(seed)
    kv_pages = rng.randint(0, 12)
    asks = [
        PoolAsk(f"pool{i}", rng.choice([ALL_PAGES, TRAILING_PAGES]), rng.randint(1, 4))
        for i in range(rng.randint(1, 3))
    ]
    held = {a.name: {p for p in range(1, 14) if rng.random() < 0.6} for a in asks}
    lengths, hits = set(range(1, kv_pages + 1)), {"kv": kv_pages} if kv_pages else {}
    for a in asks:
        pages = [i + 1 in held[a.name] for i in range(kv_pages)]
        if a.policy == ALL_PAGES:
            ok = {p for p in range(1, kv_pages + 1) if all(pages[:p])}
        else:
            ok = {p for p in range(1, kv_pages + 1) if all(pages[max(0, p - a.window) : p])}
        if ok:
            hits[a.name] = max(ok)
        lengths &= ok
    got = restorable(kv_pages, asks, held)
    assert got.lengths == sorted(lengths)
    assert got.kv_hit_pages == max(lengths, default=0)
    # a pool's own longest length is reported while every pool before it left some length
    for a in asks:
        if a.name in got.pool_hits:
            assert got.pool_hits[a.name] == hits[a.name]


@pytest.fixture
def geoms(tmp_path: Path) -> dict[str, GroupGeometry]:
    loaded = load_deployment(write_hybrid_deployment(tmp_path))
    dtypes = CacheDtypes.from_names("bfloat16", None, "float32")
    return group_geometries(loaded.layer_map().groups, dtypes, PAGE)


def shared_buffer(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A host buffer as SGLang allocates it (an anonymous mmap), random bytes."""
    count = 1
    for n in shape:
        count *= n
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    memory = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    buffer = torch.frombuffer(memory, dtype=dtype, count=count).view(shape)
    buffer.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(seed))
    return buffer


class MambaPoolHost:  # what the mapping reads of SGLang's class of this name
    def __init__(
        self,
        layout: str = "page_first_direct",
        convs: int = 1,
        layers: int = LAYERS,
        conv: tuple[tuple[int, ...], torch.dtype] = (CONV, torch.bfloat16),
    ):
        self.layout, self.num_mamba_layers = layout, layers
        self.temporal_buffer = shared_buffer((SLOTS, layers, 1, *TEMPORAL), torch.float32, 1)
        shape, dtype = conv
        self.conv_buffer = [
            shared_buffer((SLOTS, layers, 1, *shape), dtype, 2 + i) for i in range(convs)
        ]
        self.slot_state_buffers: list[Any] = []
        self.mtp_draft_buffer_infos = ()


def test_the_sidecar_sees_sglang_s_mamba_slots_as_its_state_pages(
    geoms: dict[str, GroupGeometry],
) -> None:
    group = state_group(geoms)
    assert group == "linear"
    pool = MambaPoolHost()
    state = HostState.of(pool, geoms[group])
    check_state(state, group, geoms[group])
    buffers = [pool.conv_buffer[0], pool.temporal_buffer]
    region = share_in_place([b.untyped_storage() for b in buffers], "the test's Mamba pool")
    try:
        offsets, strides = state_rows(region, state, geoms[group])
        tensors = [name for name, _ in geoms[group].tensors]
        for layer in range(LAYERS):
            for index, tensor in enumerate(tensors):
                buffer = pool.conv_buffer[0] if tensor == "conv" else pool.temporal_buffer
                row = geoms[group].row_bytes(tensor)
                for slot in range(SLOTS):  # SGLang's own indexing of the slot's layer state
                    want = buffer[slot, layer, 0].contiguous().view(torch.uint8).view(-1)
                    at = offsets[layer][index] + slot * strides[layer][index]
                    assert os.pread(region.fd, row, at) == bytes(want.tolist())
    finally:
        region.close()


def test_mamba_pools_that_do_not_fit_are_refused_naming_why(
    geoms: dict[str, GroupGeometry],
) -> None:
    geometry = geoms["linear"]
    with pytest.raises(
        SidePoolError, match=r"is layer_first; hicache maps page_first, page_first_direct"
    ):
        HostState.of(MambaPoolHost("layer_first"), geometry)
    with pytest.raises(
        SidePoolError, match=r"holds 2 conv buffers, a temporal state, 0 side-state"
    ):
        HostState.of(MambaPoolHost(convs=2), geometry)

    class SWAKVPoolHost:
        pass

    with pytest.raises(SidePoolError, match=r"is a SWAKVPoolHost; hicache maps MambaPoolHost"):
        HostState.of(SWAKVPoolHost(), geometry)
    with pytest.raises(
        SidePoolError,
        match=r"^SGLang's Mamba host pool does not match the sidecar's group 'linear': layers: "
        r"SGLang 3, sidecar 2$",
    ):
        check_state(HostState.of(MambaPoolHost(layers=3), geometry), "linear", geometry)
    # the same bytes per layer in another dtype, or another shape: refused by name (review F4)
    for conv, given in (
        ((CONV, torch.float16), r"\(256, 3\) x torch.float16"),
        (((3, 256), torch.bfloat16), r"\(3, 256\) x torch.bfloat16"),
    ):
        with pytest.raises(
            SidePoolError,
            match=rf"^SGLang's Mamba host pool does not match the sidecar's group 'linear': conv "
            rf"state: SGLang {given} \(1536 bytes per layer\), sidecar \(256, 3\) x "
            rf"torch.bfloat16 \(1536 bytes\)$",
        ):
            check_state(HostState.of(MambaPoolHost(conv=conv), geometry), "linear", geometry)
    with pytest.raises(SidePoolError, match=r"has state groups \[\]; SGLang's Mamba side pool"):
        state_group({"full": geoms["full"]})


def test_the_kv_host_pool_maps_to_the_full_group_beside_the_state_group(
    geoms: dict[str, GroupGeometry],
) -> None:
    host = HostKv("page_first_direct", 2, PAGE, 64 * PAGE, 2, 64, "bfloat16", 2)
    assert kv_group(host, geoms, PAGE) == "full"
    two_token_groups = {"full": geoms["full"], "other": geoms["full"]}
    with pytest.raises(
        HostPoolError, match=r"caches full-attention groups \['full', 'other'\]; SGLang's KV"
    ):
        kv_group(host, two_token_groups, PAGE)


def test_a_transfer_s_slots_are_one_per_key_or_refused() -> None:
    assert host_slots(torch.tensor([7]), 1) == [7]
    assert host_slots(torch.tensor([7, 8]), 1) is None
    assert host_slots(None, 1) is None


def test_an_swa_pool_maps_to_the_sliding_group_beside_the_full_group(tmp_path: Path) -> None:
    loaded = load_deployment(write_hybrid_deployment(tmp_path, "gpt_oss"))
    swa = group_geometries(loaded.layer_map().groups, CacheDtypes.uniform(torch.bfloat16), PAGE)
    host = HostKv("page_first_direct", 2, PAGE, 64 * PAGE, 2, 64, "bfloat16", 2)
    assert kv_group(host, swa, PAGE) == "full"
    assert sliding_group(swa) == "sliding"
    with pytest.raises(SidePoolError, match=r"has sliding-window groups \[\]; SGLang's SWA"):
        sliding_group({"full": swa["full"]})


def test_an_swa_window_fits_only_within_the_sliding_group_s_window(tmp_path: Path) -> None:
    """gpt-oss's sliding window is 64 tokens: 4 pages of 16; a window of 5 would have its
    leading page neither stored nor loaded by the sidecar (review F1)."""
    loaded = load_deployment(write_hybrid_deployment(tmp_path, "gpt_oss"))
    swa = group_geometries(loaded.layer_map().groups, CacheDtypes.uniform(torch.bfloat16), PAGE)
    assert [window_fits(swa["sliding"], pages, PAGE) for pages in (1, 4, 5, 8)] == [
        True,
        True,
        False,
        False,
    ]
    assert window_fits(swa["sliding"], 8, PAGE // 2)  # 8 pages of 8 tokens: 64 tokens
