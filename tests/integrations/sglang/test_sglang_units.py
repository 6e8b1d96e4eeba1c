"""The SGLang backend's parts that need no SGLang (they run in the main environment): its
settings, how SGLang's host pool maps onto the sidecar's page rows (checked byte for byte on a
buffer laid out as SGLang lays out each host layout), the host pool shared in place, the
sidecar link's states, and the page ids' namespacing."""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from hicache.client import ClientError
from hicache.config import load_deployment
from hicache.errors import ConfigError
from hicache.index.keys import keys_of_ids
from hicache.integrations.core.shared_memory import SharedMemoryError, share_in_place
from hicache.integrations.core.sidecar_link import SidecarLink
from hicache.integrations.sglang.host_pools import (
    HostKv,
    HostPoolError,
    host_pages,
    host_pool_manifest,
    kv_group,
    tenant_of,
)
from hicache.integrations.sglang.settings import BackendSettings
from hicache.memory import CacheDtypes, group_geometries

L, P, H, D, PAGES = 2, 16, 2, 16, 6
MODEL = {
    "model_type": "tiny-dense",
    "page_size_tokens": P,
    "layers": [{"kind": "full", "kv_heads": H, "head_dim": D}] * L,
}


def write_deploy(tmp_path: Path, model: dict[str, Any], name: str) -> Path:
    data = {
        "model": model,
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": "4MiB"},
        "storage": {"kind": "file", "path": str(tmp_path / "l3")},
        "service": {"socket_path": str(tmp_path / "k.sock"), "http_port": None},
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def deploy(tmp_path: Path) -> Path:
    return write_deploy(tmp_path, MODEL, "deploy.yaml")


def geometries(deploy: Path) -> dict[str, Any]:
    loaded = load_deployment(deploy)
    return group_geometries(
        loaded.layer_map().groups, CacheDtypes.from_names("bfloat16", None, None), P
    )


class MHATokenToKVPoolHost:  # what the mapping reads of SGLang's class of this name
    def __init__(self, layout: str, kv_buffer: torch.Tensor):
        self.layout, self.kv_buffer = layout, kv_buffer
        self.layer_num, self.page_size, self.size = L, P, PAGES * P
        self.head_num, self.head_dim, self.dtype = H, D, torch.bfloat16


def mapped_buffer(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bfloat16 bytes of `shape` in an anonymous mmap, as SGLang allocates host pools."""
    count = 1
    for n in shape:
        count *= n
    memory = mmap.mmap(-1, -(-count * 2 // mmap.PAGESIZE) * mmap.PAGESIZE)
    buffer = torch.frombuffer(memory, dtype=torch.bfloat16, count=count).view(shape)
    buffer.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(seed))
    return buffer


def sglang_buffer(layout: str) -> torch.Tensor:
    """A host KV buffer as SGLang allocates it in `layout`."""
    shape = {
        "layer_first": (2, L, PAGES * P, H, D),
        "page_first_direct": (2, PAGES, L, P, H, D),
        "page_first": (2, PAGES * P, L, H, D),
    }[layout]
    return mapped_buffer(shape, 7)


def sglang_row(buffer: torch.Tensor, layout: str, kv: int, layer: int, page: int) -> bytes:
    """Host page `page` of `layer` (K: kv=0, V: 1) as SGLang's own indexing reads it."""
    if layout == "layer_first":
        rows = buffer[kv, layer, page * P : (page + 1) * P]
    elif layout == "page_first_direct":
        rows = buffer[kv, page, layer]
    else:  # page_first: the page's L*R bytes token-major, cut into L rows of R bytes
        region = buffer[kv, page * P : (page + 1) * P].contiguous().view(torch.uint8).view(-1)
        size = region.numel() // L
        return bytes(region[layer * size : (layer + 1) * size].tolist())
    return bytes(rows.contiguous().view(torch.uint8).view(-1).tolist())


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct", "page_first"])
def test_the_sidecar_sees_sglang_host_pages_as_its_page_rows(deploy: Path, layout: str) -> None:
    buffer = sglang_buffer(layout)
    before = bytes(buffer.view(torch.uint8).view(-1).tolist())
    host = HostKv.of(MHATokenToKVPoolHost(layout, buffer))
    geoms = geometries(deploy)
    group = kv_group(host, geoms, P)
    region = share_in_place([buffer.untyped_storage()], "the test's host pool")
    try:
        assert bytes(buffer.view(torch.uint8).view(-1).tolist()) == before  # kept in place
        pools = host_pool_manifest(region, buffer, host, group, geoms[group])
        views = pools.device_pools()[group].tensors
        for layer in range(L):
            for kv, tensor in enumerate(("k", "v")):
                rows = views[layer][tensor]
                assert tuple(rows.shape) == (PAGES, host.row_bytes)
                for page in range(PAGES):
                    got = bytes(rows[page].tolist())
                    assert got == sglang_row(buffer, layout, kv, layer, page), (layer, tensor, page)
        # the sidecar's mapping of the memfd and SGLang's tensor are the same memory
        buffer.view(torch.uint8).view(-1)[:8] = torch.arange(8, dtype=torch.uint8)
        assert os.pread(region.fd, 8, 0) == bytes(range(8))
        pools.close()
    finally:
        region.close()


def test_host_pools_that_do_not_fit_are_refused_naming_each_difference(deploy: Path) -> None:
    host = HostKv("layer_first", 3, 8, 64, 2, 64, "bfloat16", 2)
    with pytest.raises(
        HostPoolError,
        match=r"^SGLang's host pool does not match the sidecar's group '\w+': page size: SGLang 8, "
        r"sidecar 16; layers: SGLang 3, sidecar 2; k page row: SGLang 8 x 2 heads x 64 x "
        r"bfloat16 \(2048 bytes\), sidecar 16 x 2 heads x 16 x bfloat16 \(1024 bytes\); v page "
        r"row: SGLang .*\(2048 bytes\), sidecar .*\(1024 bytes\)$",
    ):
        kv_group(host, geometries(deploy), 16)
    # the same bytes in another dtype, or another split of heads: refused all the same
    # (engines of either would share pages and read each other's bytes wrong; review F4)
    for host, given in (
        (HostKv("layer_first", 2, 16, 64, 2, 16, "float16", 2), r"2 heads x 16 x float16"),
        (HostKv("layer_first", 2, 16, 64, 1, 32, "bfloat16", 2), r"1 heads x 32 x bfloat16"),
    ):
        with pytest.raises(
            HostPoolError,
            match=rf"^SGLang's host pool does not match the sidecar's group 'full': k page row: "
            rf"SGLang 16 x {given} \(1024 bytes\), sidecar 16 x 2 heads x 16 x bfloat16 "
            rf"\(1024 bytes\); v page row: .*$",
        ):
            kv_group(host, geometries(deploy), 16)
    fits = HostKv("layer_first", 2, 16, 64, 2, 16, "bfloat16", 2)
    assert kv_group(fits, geometries(deploy), 16) == "full"


def test_only_mha_and_mla_host_pools_in_the_copyable_layouts_are_mapped() -> None:
    class NSATokenToKVPoolHost:
        pass

    with pytest.raises(
        HostPoolError,
        match=r"is a NSATokenToKVPoolHost; hicache maps MHATokenToKVPoolHost \(MHA/GQA models\) "
        r"and MLATokenToKVPoolHost \(MLA models\)$",
    ):
        HostKv.of(NSATokenToKVPoolHost())
    odd = MHATokenToKVPoolHost("page_unified", torch.zeros(1))
    with pytest.raises(
        HostPoolError,
        match=r"--hicache-mem-layout page_unified: hicache maps layer_first, page_first_direct, page_first, page_head",
    ):
        HostKv.of(odd)


def test_host_indices_are_whole_pages_or_refused() -> None:
    slots = torch.tensor([32 + i for i in range(16)] + [80 + i for i in range(16)])
    assert host_pages(slots, 16, 2) == [2, 5]
    assert host_pages(slots, 16, 3) is None  # not 3 pages of slots
    assert host_pages(slots + 1, 16, 2) is None  # not on page starts


def test_tenants_follow_the_bytes_a_page_row_holds() -> None:
    assert tenant_of("layer_first") == tenant_of("page_first_direct") == "sglang"
    assert tenant_of("page_first") == "sglang-page-first"
    assert tenant_of("page_head") == "sglang-page-head"


def test_settings_are_checked_key_by_key(deploy: Path) -> None:
    base = {"backend_name": "hicache", "interface_v1": 1, "config": str(deploy)}
    settings = BackendSettings.parse(base | {"prefetch_threshold": 16})
    assert (settings.timeout_s, settings.load_timeout_s, settings.retry_after_s) == (5.0, 10.0, 1.0)
    with pytest.raises(
        ConfigError, match=r"unknown keys \['bogus'\]; hicache's: config, token, tenant"
    ):
        BackendSettings.parse(base | {"bogus": 1})
    with pytest.raises(ConfigError, match=r"interface_v1 is None; set \"interface_v1\": 1"):
        BackendSettings.parse({"config": str(deploy)})
    with pytest.raises(
        ConfigError, match=r"config is None; give the path of the sidecar's deployment file"
    ):
        BackendSettings.parse({"interface_v1": 1})
    with pytest.raises(ConfigError, match=r"load_timeout_s is -1; give a number of seconds > 0"):
        BackendSettings.parse(base | {"load_timeout_s": -1})
    # an MLA writer's wait for L3: within one request to the sidecar
    assert settings.persisted_within_s == 2.5
    assert BackendSettings.parse(base | {"timeout_s": 10}).persisted_within_s == 3.0
    assert BackendSettings.parse(base | {"timeout_s": 1}).persisted_within_s == 0.5
    with pytest.raises(
        ConfigError,
        match=r"persisted_within_s is 5.0 and timeout_s 5.0; persisted_within_s must be less "
        r"than timeout_s",
    ):
        BackendSettings.parse(base | {"persisted_within_s": 5})
    with pytest.raises(ConfigError, match=r"persisted_within_s is 0; give a number of seconds"):
        BackendSettings.parse(base | {"persisted_within_s": 0})


def test_sharing_in_place_refuses_a_file_mapping(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    with path.open("r+b") as f:
        memory = mmap.mmap(f.fileno(), mmap.PAGESIZE)
        tensor = torch.frombuffer(memory, dtype=torch.uint8)
        with pytest.raises(
            SharedMemoryError,
            match=r"the file's pool at .* lies in the mapping '.*/f'; only read-write anonymous, /dev/zero or memfd memory is shared in place",
        ):
            share_in_place([tensor.untyped_storage()], "the file's pool")
        del tensor
        memory.close()


def test_page_ids_are_keyed_per_namespace() -> None:
    root_a, root_b = b"a" * 16, b"b" * 16
    ids = [b"0" * 64, b"1" * 64]
    keys_a = keys_of_ids(root_a, "xxh3_128", ids)
    assert keys_a == keys_of_ids(root_a, "xxh3_128", ids)  # deterministic
    assert len(set(keys_a)) == 2
    assert not set(keys_a) & set(keys_of_ids(root_b, "xxh3_128", ids))


class FakeClient:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_the_sidecar_link_never_raises_and_logs_an_outage_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outcomes: list[Any] = [ConnectionRefusedError("no sidecar"), FakeClient(), FakeClient()]
    registered: list[Any] = []

    def connect() -> Any:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    log = logging.getLogger("test.link")
    link = SidecarLink(connect, registered.append, retry_after_s=0.0, name="t", log=log)
    with caplog.at_level(logging.WARNING, logger="test.link"):
        assert link.use("op", lambda c: 1, default=0) == 0  # down: the default
        assert link.counters.outages == 1
        assert link.use("op", lambda c: 2, default=0) == 2  # back: connected, registered
        first = registered[0]
        assert link.up
        assert (
            link.use("op", lambda c: (_ for _ in ()).throw(ClientError("bad", "no")), default=-1)
            == -1
        )
        assert link.counters.refusals == 1
        assert link.up  # a refusal leaves the link up
        assert (
            link.use("op", lambda c: (_ for _ in ()).throw(ConnectionResetError()), default=-1)
            == -1
        )
        assert first.closed
        assert not link.up
        assert link.counters.outages == 2
        assert link.use("op", lambda c: 3, default=0) == 3  # reconnected
    messages = [r.getMessage() for r in caplog.records]
    assert sum("sidecar unavailable" in m for m in messages) == 2  # once per outage
    assert sum("sidecar back" in m for m in messages) == 2
    link.close()
    assert link.use("op", lambda c: 4, default=0) == 0  # closed: terminal


def test_a_down_sidecar_is_tried_again_only_after_retry_after_s() -> None:
    tries: list[int] = []

    def connect() -> Any:
        tries.append(1)
        raise ConnectionRefusedError("no sidecar")

    link = SidecarLink(
        connect, lambda c: None, retry_after_s=3600, name="t", log=logging.getLogger("t")
    )
    for _ in range(5):
        assert link.use("op", lambda c: 1, default=0) == 0
    assert len(tries) == 1


def test_the_demo_help_names_both_engines(capsys: pytest.CaptureFixture[str]) -> None:
    from hicache.cli.main import main

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "vLLM through its KV connector (hicache.integrations.vllm)" in text
    assert "SGLang through its HiCache storage backend (hicache.integrations.sglang)" in text


# ---- MLA: SGLang's MLATokenToKVPoolHost, one latent per token and layer --------------------

LATENT = 96  # kv_lora_rank 64 + qk_rope_head_dim 32
MLA_MODEL = {
    "model_type": "tiny-mla",
    "page_size_tokens": P,
    "layers": [{"kind": "full", "kv_format": "mla", "head_dim": LATENT}] * L,
}


@pytest.fixture
def mla_deploy(tmp_path: Path) -> Path:
    return write_deploy(tmp_path, MLA_MODEL, "mla.yaml")


class MLATokenToKVPoolHost:  # what the mapping reads of SGLang's class of this name
    def __init__(self, layout: str, kv_buffer: torch.Tensor | None, **over: Any):
        self.layout, self.kv_buffer = layout, kv_buffer
        self.layer_num = self.target_layer_num = L
        self.page_size, self.size, self.kv_cache_dim, self.dtype = (
            P,
            PAGES * P,
            LATENT,
            torch.bfloat16,
        )
        self._native_buffers, self.dsa_kv_cache_store_fp8 = None, False
        vars(self).update(over)


def mla_buffer(layout: str) -> torch.Tensor:
    """An MLA host buffer as SGLang's `init_kv_buffer` shapes it, in `layout`."""
    shape = {
        "layer_first": (L, PAGES * P, 1, LATENT),
        "page_first_direct": (PAGES, L, P, 1, LATENT),
        "page_first": (PAGES * P, L, 1, LATENT),
    }[layout]
    return mapped_buffer(shape, 11)


def mla_row(buffer: torch.Tensor, layout: str, layer: int, page: int) -> bytes:
    """Host page `page` of `layer` as SGLang's own indexing of its MLA pool reads it."""
    if layout == "layer_first":
        rows = buffer[layer, page * P : (page + 1) * P]
    elif layout == "page_first_direct":
        rows = buffer[page, layer]
    else:  # page_first: the page's L*R bytes token-major, cut into L rows of R bytes
        region = buffer[page * P : (page + 1) * P].contiguous().view(torch.uint8).view(-1)
        size = region.numel() // L
        return bytes(region[layer * size : (layer + 1) * size].tolist())
    return bytes(rows.contiguous().view(torch.uint8).view(-1).tolist())


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct", "page_first"])
def test_the_sidecar_sees_sglang_mla_host_pages_as_its_latent_rows(
    mla_deploy: Path, layout: str
) -> None:
    buffer = mla_buffer(layout)
    host = HostKv.of(MLATokenToKVPoolHost(layout, buffer))
    assert (host.latent, host.tensors, host.heads, host.head_dim) == (True, ("kv",), 1, LATENT)
    geoms = geometries(mla_deploy)
    group = kv_group(host, geoms, P)
    assert geoms[group].group.replicated  # one page serves every TP rank (cache.keyers)
    region = share_in_place([buffer.untyped_storage()], "the test's MLA host pool")
    try:
        pools = host_pool_manifest(region, buffer, host, group, geoms[group])
        views = pools.device_pools()[group].tensors
        for layer in range(L):
            assert list(views[layer]) == ["kv"]
            rows = views[layer]["kv"]
            assert tuple(rows.shape) == (PAGES, P * LATENT * 2)
            for page in range(PAGES):
                assert bytes(rows[page].tolist()) == mla_row(buffer, layout, layer, page)
        pools.close()
    finally:
        region.close()


def test_mla_host_pools_that_do_not_fit_are_refused_naming_each_difference(
    deploy: Path, mla_deploy: Path
) -> None:
    buffer = mla_buffer("layer_first")
    with pytest.raises(
        HostPoolError,
        match=r"^SGLang's host pool does not match the sidecar's group 'full': tensors: SGLang "
        r"the MLA latent \('kv'\), sidecar \['k', 'v'\]$",
    ):
        kv_group(HostKv.of(MLATokenToKVPoolHost("layer_first", buffer)), geometries(deploy), P)
    narrow = HostKv.of(MLATokenToKVPoolHost("layer_first", buffer, kv_cache_dim=64))
    with pytest.raises(
        HostPoolError,
        match=r"kv page row: SGLang 16 x 1 heads x 64 x bfloat16 \(2048 bytes\), sidecar 16 x 1 "
        r"heads x 96 x bfloat16 \(3072 bytes\)$",
    ):
        kv_group(narrow, geometries(mla_deploy), P)
    with pytest.raises(
        HostPoolError,
        match=r"^SGLang's host pool does not match the sidecar's group 'full': tensors: SGLang K and V, sidecar \['kv'\]$",
    ):
        kv_group(
            HostKv.of(MHATokenToKVPoolHost("layer_first", sglang_buffer("layer_first"))),
            geometries(mla_deploy),
            P,
        )


@pytest.mark.parametrize(
    ("over", "why"),
    [
        (
            {"layout": "page_unified"},
            r"--hicache-mem-layout page_unified with an MLA model: hicache maps layer_first, page_first_direct, page_first$",
        ),
        (
            {"_native_buffers": object()},
            r"holds its MLA buffers split natively \(NPU's DSA / NSA\); hicache maps one latent "
            r"buffer",
        ),
        ({"dsa_kv_cache_store_fp8": True}, r"holds packed FP8 rows; hicache maps"),
        ({"layer_num": L + 1}, r"holds 1 MTP draft layers; hicache maps"),
        ({"kv_buffer": None}, r"holds no host buffer \(allocator-only\); hicache maps"),
    ],
)
def test_mla_host_pool_variants_hicache_does_not_map_are_refused_by_name(
    over: dict[str, Any], why: str
) -> None:
    fields = {"layout": "layer_first", "kv_buffer": torch.zeros(1)} | over
    pool = MLATokenToKVPoolHost(fields.pop("layout"), fields.pop("kv_buffer"), **fields)
    with pytest.raises(HostPoolError, match=why):
        HostKv.of(pool)
