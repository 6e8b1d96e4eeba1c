"""The SGLang linker's pure parts, without SGLang (main venv): page hashes as keys, slots as
page ids, SGLang's pool tensors checked against the sidecar's geometry and shared (in place or
rebacked) with every byte kept and every offset where the sidecar will look, the settings
and the session: the core's `SidecarLink`, whose `drop` ends a client a load could not
confirm stopped."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import mmap
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.client.keys import KeySpec
from hicache.errors import ConfigError, PoolShapeError
from hicache.index.keys import keys_of_ids
from hicache.integrations.core.shared_memory import SharedMemoryError, plan_regions
from hicache.integrations.core.sidecar_link import SidecarLink
from hicache.integrations.sglang.linker_components import LinkedPools
from hicache.integrations.sglang.linker_keys import (
    digest_of,
    keys_of_hashes,
    restorable_lengths,
)
from hicache.integrations.sglang.linker_pool import (
    KvTensors,
    page_ids,
    reback,
    reback_pools,
    share_kv,
    shared_pools_of,
    token_groups,
)
from hicache.integrations.sglang.linker_settings import LinkerSettings
from hicache.integrations.sglang.linker_state import StateTensors, state_slot
from hicache.memory import CacheDtypes, group_geometries
from hicache.model import CacheKind, LayerMap, layout_from_hf_config

ROOT = bytes(range(16))


def hashes(n: int, seed: bytes = b"s") -> list[str]:
    out, previous = [], seed
    for i in range(n):
        previous = hashlib.sha256(previous + bytes([i])).digest()
        out.append(previous.hex())
    return out


@pytest.mark.parametrize("page", [1, 3, 8, 16])
def test_each_page_key_stands_alone_and_is_the_storage_backends_key(page: int) -> None:
    spec = KeySpec(page, "xxh3_128", {"full": ROOT})
    pages = hashes(5)
    whole = keys_of_hashes(spec, pages)
    assert whole.num_tokens == 5 * page
    assert whole.pages == 5
    tail = keys_of_hashes(spec, pages[2:])
    assert whole.blobs["full"][2 * 16 :] == tail.blobs["full"]  # position-independent
    # one mechanism: the storage backend's ids (the hash's text) under the same namespace
    assert whole.blobs["full"] == b"".join(
        keys_of_ids(ROOT, "xxh3_128", [h.encode() for h in pages])
    )
    # a digest differing in its last bit only is another key
    last = bytearray(bytes.fromhex(pages[0]))
    last[-1] ^= 1
    assert keys_of_hashes(spec, [last.hex()]).blobs["full"] != whole.blobs["full"][:16]
    # another namespace's root keys the same page differently
    other = KeySpec(page, "xxh3_128", {"full": bytes(16)})
    assert keys_of_hashes(other, pages[:1]).blobs["full"] != whole.blobs["full"][:16]


def test_bad_page_hashes_are_refused_by_value() -> None:
    with pytest.raises(ConfigError, match=r"SGLang page hash 'abc' is not 64 hex digits"):
        digest_of("abc")
    with pytest.raises(ConfigError, match=r"is not hexadecimal"):
        digest_of("z" * 64)
    spec = KeySpec(4, "xxh3_128", {"full": ROOT})
    with pytest.raises(ConfigError, match=r"SGLang page hash 'short' is not 64 hex digits"):
        keys_of_hashes(spec, [*hashes(2), "short"])


def test_restorable_lengths_are_every_prefix_up_to_the_hit() -> None:
    assert restorable_lengths(48, 16, 5) == [1, 2, 3]
    assert restorable_lengths(47, 16, 5) == [1, 2]
    assert restorable_lengths(160, 16, 4) == [1, 2, 3, 4]
    assert restorable_lengths(0, 16, 4) == []


def test_slots_become_page_ids_only_for_whole_ordered_pages() -> None:
    assert page_ids(torch.arange(32, 64), 16) == [2, 3]
    assert page_ids(torch.cat([torch.arange(64, 80), torch.arange(16, 32)]), 16) == [4, 1]
    assert page_ids(torch.arange(33, 49), 16) is None  # not page-aligned
    assert page_ids(torch.arange(32, 40), 16) is None  # part of a page
    assert page_ids(torch.tensor([32, 34, *list(range(34, 48))]), 16) is None  # a hole


def tiny_geometry(page: int = 16, heads: int = 2, dim: int = 32) -> Any:
    layout = layout_from_hf_config(
        {
            "model_type": "qwen2",
            "num_hidden_layers": 2,
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": heads,
            "head_dim": dim,
        },
        "tiny",
    )
    geometries = group_geometries(LayerMap(layout).groups, CacheDtypes.from_names("bfloat16"), page)
    return token_groups(geometries)[0]


def sglang_pool(page: int = 16, slots: int = 4096, heads: int = 2, dim: int = 32) -> Any:
    """What MHATokenToKVPool keeps: per layer one allocation, K and V its halves."""
    fused = [torch.zeros((2, slots + page, heads, dim), dtype=torch.bfloat16) for _ in range(2)]
    return types.SimpleNamespace(
        k_buffer=[b[0] for b in fused], v_buffer=[b[1] for b in fused], page_size=page
    )


def test_pool_tensors_are_checked_against_the_geometry() -> None:
    tensors = KvTensors.of(sglang_pool())
    assert tensors.num_pages == 257
    assert tensors.num_layers == 2
    tensors.check(tiny_geometry())
    with pytest.raises(
        PoolShapeError, match=r"page size: SGLang 16 tokens, the sidecar's deployment 32"
    ):
        tensors.check(tiny_geometry(page=32))
    with pytest.raises(PoolShapeError, match=r"tensor 'k': SGLang keeps 16 slots of \(2, 32\)"):
        tensors.check(tiny_geometry(heads=4))
    hnd = sglang_pool()
    hnd.use_hnd = True
    with pytest.raises(PoolShapeError, match=r"token-slot rows \('nhd'\) only"):
        KvTensors.of(hnd)
    mla = types.SimpleNamespace(kv_buffer=[torch.zeros(4, 1, 8)], page_size=16)
    with pytest.raises(PoolShapeError, match=r"no per-layer k_buffer / v_buffer"):
        KvTensors.of(mla)


def written(pool: Any) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for t in pool.k_buffer + pool.v_buffer:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        out.append(t.clone())
    return out


@pytest.mark.parametrize("how", ["in place", "rebacked"])
def test_shared_pool_keeps_every_byte_where_the_sidecar_looks(how: str) -> None:
    pool = sglang_pool()
    before = written(pool)
    tensors = KvTensors.of(pool)
    memory = reback(tensors, pool) if how == "rebacked" else share_kv(tensors, pool)[0]
    tensors = KvTensors.of(pool)
    assert [
        torch.equal(a, b) for a, b in zip(before, pool.k_buffer + pool.v_buffer, strict=False)
    ] == [True] * 4
    shared = tensors.shared_pools(memory, tiny_geometry())
    view = torch.frombuffer(mmap.mmap(memory.fd, memory.nbytes), dtype=torch.uint8)
    row = 16 * 2 * 32 * 2
    for layer in range(2):
        for index, tensor in enumerate((pool.k_buffer[layer], pool.v_buffer[layer])):
            offset = shared.offsets["full"][layer][index]
            stride = shared.page_strides["full"][layer][index]  # type: ignore[index]
            for page in (0, 1, 256):
                seen = view[offset + page * stride : offset + page * stride + row]
                want = (
                    tensor[page * 16 : (page + 1) * 16].contiguous().view(torch.uint8).reshape(-1)
                )
                assert torch.equal(seen, want), (how, layer, index, page)
            tensor[5].fill_(3.0)  # the engine's writes reach the memfd, and back
            start = offset + 5 * 2 * 32 * 2
            assert torch.equal(
                view[start : start + 128], tensor[5].contiguous().view(torch.uint8).reshape(-1)
            )
    shared.close()
    memory.close()


def test_overlapping_or_missing_allocations_are_refused() -> None:
    with pytest.raises(SharedMemoryError, match=r"no allocation of the KV memory to share"):
        plan_regions([])
    empty = types.SimpleNamespace(data_ptr=lambda: 4096, nbytes=lambda: 0)
    with pytest.raises(
        SharedMemoryError, match=r"the KV memory: the allocation at 0x1000 is empty \(0 bytes\)"
    ):
        plan_regions([empty])


def test_a_reach_limits_the_remapped_pages_to_the_tensors_and_stays_inside_them() -> None:
    """`reach` (the vLLM connector's: its rows' span): only the whole pages under it are
    planned, so the memfd ends where the tensors do; a reach outside its allocation, or one
    reach too few, is refused by name before anything is remapped."""
    page = mmap.PAGESIZE
    area = mmap.mmap(-1, 8 * page)
    storage = torch.frombuffer(area, dtype=torch.uint8).untyped_storage()
    base = storage.data_ptr()
    (whole,) = plan_regions([storage])
    assert (whole.base, whole.nbytes) == (base, 8 * page)
    (part,) = plan_regions([storage], "the rows", [(base + page + 16, base + 3 * page + 1)])
    assert (part.base, part.offset, part.nbytes) == (base + page, 0, 3 * page)
    # the same allocation twice: the union of its reaches
    (both,) = plan_regions(
        [storage, storage], "the rows", [(base + 5 * page, base + 6 * page), (base, base + 8)]
    )
    assert (both.base, both.nbytes) == (base, 6 * page)
    with pytest.raises(
        SharedMemoryError,
        match=rf"^the rows: its tensors reach {base:#x}\.\.{base + 9 * page:#x}, outside "
        rf"their allocation {base:#x}\.\.{base + 8 * page:#x}$",
    ):
        plan_regions([storage], "the rows", [(base, base + 9 * page)])
    with pytest.raises(
        SharedMemoryError, match=r"^the rows: 1 reaches given for 2 allocations; one each$"
    ):
        plan_regions([storage, storage], "the rows", [(base, base + 8)])
    del storage


def test_settings_are_checked_key_by_key(tmp_path: Path) -> None:
    settings = LinkerSettings.parse({"address": "/run/h.sock", "load_timeout_s": 3})
    assert (settings.address, settings.tenant, settings.load_timeout_s) == (
        "/run/h.sock",
        "sglang-nhd",
        3.0,
    )
    with pytest.raises(ConfigError, match=r"linker_extra_config: unknown keys \['sockett'\]"):
        LinkerSettings.parse({"sockett": "x"})
    with pytest.raises(
        ConfigError, match=r"give 'config' \(the sidecar's deploy.yaml\) or 'address'"
    ):
        LinkerSettings.parse({})
    with pytest.raises(
        ConfigError, match=r"linker_extra_config.retry_after_s: 0 is not a positive"
    ):
        LinkerSettings.parse({"address": "a.sock", "retry_after_s": 0})


class FakeClient:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_a_load_that_did_not_end_drops_the_links_client(caplog: pytest.LogCaptureFixture) -> None:
    """The linker's session is the core's `SidecarLink`; a load it cannot confirm stopped
    drops the client (`drop`): closed, the link down (one warning), then connected again; a
    stale client is only closed, the current one kept."""
    made: list[FakeClient] = []

    def connect() -> Any:
        made.append(FakeClient())
        return made[-1]

    link = SidecarLink(
        connect, lambda c: None, retry_after_s=0.0, name="linker", log=logging.getLogger("t.l")
    )
    with caplog.at_level(logging.WARNING, "t.l"):
        first = link.client()
        assert first is made[0]
        link.drop(first, "load r1 did not end (TimeoutError: layer 3)")
        assert first.closed
        assert not link.up
        assert link.counters.outages == 1
        second = link.client()
        assert second is made[1]
        assert second is not first
        stale = FakeClient()
        link.drop(stale, "an old client")  # not the link's: closed, the link stays up
        assert stale.closed
        assert link.client() is second
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "load r1 did not end (TimeoutError: layer 3)" in messages[0]
    assert "sidecar back" in messages[1]
    link.close()
    assert second.closed
    assert link.client() is None


def gpt_oss_geometries(page: int = 16) -> Any:
    """A tiny gpt-oss's groups: sliding layers 0 and 2, full layers 1 and 3 (2 heads x 64)."""
    layout = layout_from_hf_config(
        {
            "model_type": "gpt_oss",
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "sliding_window": 64,
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
        },
        "tiny-gpt-oss",
    )
    return group_geometries(LayerMap(layout).groups, CacheDtypes.from_names("bfloat16"), page)


def swa_pool(layer_ids: tuple[list[int], list[int]] = ([1, 3], [0, 2])) -> Any:
    """What SGLang's SWAKVPool holds: a full and an SWA MHA pool, each with its model layers."""
    full, swa = sglang_pool(dim=64, slots=256), sglang_pool(dim=64, slots=128)
    full.model_layer_ids, swa.model_layer_ids = tuple(layer_ids[0]), tuple(layer_ids[1])
    return types.SimpleNamespace(full_kv_pool=full, swa_kv_pool=swa, layer_num=4)


def test_the_components_are_the_sidecars_full_and_sliding_groups() -> None:
    geometries = gpt_oss_geometries()
    full, sliding, state = token_groups(geometries)
    assert state is None
    assert (full.group.kind.value, sliding.group.kind.value) == ("full", "sliding")
    kv = swa_pool()
    linked = LinkedPools.of(kv, geometries, cuda=False)
    assert {n: c.layer_ids for n, c in linked.components.items()} == {
        "kv": (1, 3),
        "swa": (0, 2),
    }
    # a store names every token group: the pool's own pages, None for the other's
    assert linked.pages_of("swa", [4, 5]) == {
        full.group.name: [None, None],
        sliding.group.name: [4, 5],
    }
    shared = shared_pools_of(
        linked.memory, [(c.tensors, c.geometry) for c in linked.components.values()]
    )
    assert sorted(shared.offsets) == sorted(geometries)
    assert shared.num_pages == {full.group.name: 17, sliding.group.name: 9}  # (slots + 1 page) / 16
    # both pools under one memfd: the SWA pool's layer 1 V rows where the manifest says
    view = torch.frombuffer(mmap.mmap(linked.memory.fd, linked.memory.nbytes), dtype=torch.uint8)
    v = kv.swa_kv_pool.v_buffer[1]
    v[16:32].fill_(2.0)
    offset = (
        shared.offsets[sliding.group.name][1][1] + shared.page_strides[sliding.group.name][1][1]
    )  # type: ignore[index]
    assert torch.equal(
        view[offset : offset + 16 * 2 * 64 * 2], v[16:32].contiguous().view(torch.uint8).reshape(-1)
    )
    shared.close()
    linked.close()


def test_pools_that_are_not_the_sidecars_groups_are_refused_by_name() -> None:
    geometries = gpt_oss_geometries()
    with pytest.raises(
        PoolShapeError, match=r"SGLang's 'kv' pool holds layers \[0, 2\]; the sidecar's group"
    ):
        LinkedPools.of(swa_pool(([0, 2], [1, 3])), geometries, cuda=False)
    with pytest.raises(
        PoolShapeError, match=r"\(no sliding-window pool\); the sidecar's model has sliding group"
    ):
        LinkedPools.of(sglang_pool(dim=64), geometries, cuda=False)
    no_layers = swa_pool()
    no_layers.layer_num = 6
    with pytest.raises(
        PoolShapeError,
        match=r"SGLang's KV pool counts 6 layers; the sidecar's groups hold layers \[0, 1, 2, 3\]",
    ):
        LinkedPools.of(no_layers, geometries, cuda=False)
    with pytest.raises(
        PoolShapeError, match=r"SGLang has no Mamba pool; the sidecar's model has state group"
    ):
        LinkedPools.of(sglang_pool(dim=64), qwen3_next_geometries(), cuda=False)
    chunked = {
        "full": tiny_geometry(),
        "chunked": types.SimpleNamespace(group=types.SimpleNamespace(kind=CacheKind.CHUNKED)),
    }
    with pytest.raises(PoolShapeError, match=r"not moved: chunked \(chunked\)"):
        token_groups(chunked)


def qwen3_next_geometries() -> Any:
    """A tiny Qwen3-Next's groups: linear-attention state (layers 0, 2) and full (1, 3)."""
    layout = layout_from_hf_config(
        {
            "model_type": "qwen3_next",
            "num_hidden_layers": 4,
            "full_attention_interval": 2,
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
        },
        "tiny-qwen3-next",
    )
    dtypes = CacheDtypes.from_names("bfloat16", ssm_state="float32")
    return group_geometries(LayerMap(layout).groups, dtypes, 16)


@dataclasses.dataclass(frozen=True)
class MambaState:
    """What SGLang's `MambaPool.State` holds (its ReplaySSM rings off)."""

    conv: list[torch.Tensor]
    temporal: torch.Tensor
    replayssm_d: torch.Tensor | None = None


def mamba_pool(slots: int = 8, ssm: torch.dtype = torch.float32) -> Any:
    conv = torch.zeros((2, slots + 1, 256, 3), dtype=torch.bfloat16)
    temporal = torch.zeros((2, slots + 1, 4, 32, 32), dtype=ssm)
    return types.SimpleNamespace(mamba_cache=MambaState([conv], temporal), mamba_layer_ids=[0, 2])


def test_the_mamba_pool_is_the_state_groups_slots_and_refused_by_name() -> None:
    geometries = qwen3_next_geometries()
    state = token_groups(geometries)[2]
    assert state is not None
    pool = mamba_pool()
    view = StateTensors.of(pool, state)
    assert view.layer_ids == (0, 2)
    assert view.num_pages == 9
    memory = reback_pools([(view, pool)])
    view = StateTensors.of(pool, state)  # the pool's new cache, over the memfd
    offsets, strides = view.rows(memory)
    mapped = torch.frombuffer(mmap.mmap(memory.fd, memory.nbytes), dtype=torch.uint8)
    pool.mamba_cache.temporal[1, 5].fill_(1.5)  # layer 2's state in slot 5
    names = [name for name, _ in state.tensors]
    at = names.index(next(n for n in names if n != "conv"))
    start = offsets[1][at] + 5 * strides[1][at]
    row = pool.mamba_cache.temporal[1, 5].contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(mapped[start : start + row.numel()], row)
    memory.close()
    with pytest.raises(
        PoolShapeError,
        match=r"SGLang's Mamba temporal state \(the sidecar's 'recurrent'\) is \(2, 9, 4, 32, 32\) "
        r"torch.bfloat16 .*: 8192 bytes a slot and layer; the sidecar's state group 'linear' keeps "
        r"2 layers of 16384 bytes",
    ):
        StateTensors.of(mamba_pool(ssm=torch.bfloat16), state)
    swapped = mamba_pool()
    swapped.mamba_layer_ids = [1, 3]
    with pytest.raises(
        PoolShapeError, match=r"SGLang's Mamba pool holds layers \[1, 3\]; the sidecar's state"
    ):
        StateTensors.of(swapped, state)
    rings = mamba_pool()
    rings.mamba_cache = dataclasses.replace(rings.mamba_cache, replayssm_d=torch.zeros(1))
    with pytest.raises(PoolShapeError, match=r"ReplaySSM rings"):
        StateTensors.of(rings, state)


def test_a_state_transfer_names_one_slot() -> None:
    assert state_slot(torch.tensor([5])) == [5]
    assert state_slot(torch.tensor(5)) == [5]  # a 0-d index
    assert state_slot(torch.tensor([5, 6])) is None
    assert state_slot(torch.tensor([], dtype=torch.int64)) is None
