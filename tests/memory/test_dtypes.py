"""Per-tensor dtypes: a hybrid model's state beside its KV in dtypes of their own (vLLM's
mamba_cache_dtype / mamba_ssm_cache_dtype, SGLang's mamba_ssm_dtype), fp8 caches held in
uint8 tensors, the errors when a dtype is missing or wrong, and byte-exact copies of a
mixed-dtype group through both host layouts."""

from __future__ import annotations

import random

import pytest
import torch

from hicache.errors import ConfigError, PoolShapeError
from hicache.index.keys import Namespace
from hicache.memory import CacheDtypes, DevicePool, GroupGeometry, HostPool
from hicache.model import CacheGroup, CacheKind, CacheSpec, KvFormat, LayerMap, load_layout
from hicache.transfer import CpuCopyBackend, Direction, GroupMove, copy_layers_blocking
from tests.conftest import shared_model

MAMBA = CacheGroup(
    "mamba",
    CacheSpec(CacheKind.MAMBA, state_shapes=(("conv", (6, 3)), ("ssm", (2, 4, 5)))),
    (0, 2),
)
FULL = CacheGroup(
    "full", CacheSpec(CacheKind.FULL, KvFormat.MHA, num_kv_heads=2, head_dim=8, v_head_dim=8), (1,)
)
FP32_SSM = CacheDtypes.from_names("bfloat16", ssm_state="float32")


def test_the_ssm_state_takes_its_own_dtype_and_size() -> None:
    geom = GroupGeometry.of(MAMBA, FP32_SSM, 16)
    assert geom.dtype_of("conv") == torch.bfloat16
    assert geom.dtype_of("ssm") == torch.float32
    assert geom.row_bytes("conv") == 6 * 3 * 2  # one snapshot per page
    assert geom.row_bytes("ssm") == 2 * 4 * 5 * 4
    assert geom.page_bytes == 2 * (36 + 160)
    assert geom.dtype_signature == "bfloat16 ssm=float32"
    kv = GroupGeometry.of(FULL, FP32_SSM, 16)  # the KV is untouched by state dtypes
    assert kv.dtype_signature == "bfloat16"
    assert kv.row_bytes("k") == 16 * 2 * 8 * 2


def test_defaults_follow_the_kv_then_the_state() -> None:
    assert CacheDtypes.from_names("float16") == CacheDtypes.uniform(torch.float16)
    both = CacheDtypes.from_names("bfloat16", state="float32")
    assert (both.state, both.ssm_state) == (torch.float32, torch.float32)


def test_states_beside_an_fp8_kv_need_a_dtype_given() -> None:
    fp8 = CacheDtypes.from_names("float8_e4m3fn")
    assert GroupGeometry.of(FULL, fp8, 16).dtype_of("k") == torch.float8_e4m3fn
    with pytest.raises(ConfigError) as info:
        GroupGeometry.of(MAMBA, fp8, 16)
    assert str(info.value).startswith(
        "state tensor 'conv' has no dtype: model.dtype is fp8, which engines use for the KV "
        "only; set model.state_dtype to the dtype of the engine's state cache (vLLM: "
        "mamba_cache_dtype / mamba_ssm_cache_dtype, 'auto' = the model's dtype; SGLang: the "
        "model's dtype / mamba_ssm_dtype); allowed: ['bfloat16', 'float16', 'float32', "
    )
    given = CacheDtypes.from_names("float8_e4m3fn", state="bfloat16", ssm_state="float32")
    assert GroupGeometry.of(MAMBA, given, 16).dtype_signature == "bfloat16 ssm=float32"


def test_a_dtype_for_a_tensor_the_group_lacks_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"dtypes given for tensors \['ssm'\] it does not have"):
        GroupGeometry(FULL, torch.bfloat16, 16, (("ssm", torch.float32),))


def test_an_fp8_pool_takes_uint8_or_fp8_tensors_and_nothing_else() -> None:
    geom = GroupGeometry.of(FULL, CacheDtypes.from_names("float8_e5m2"), 4)
    for dtype in (torch.uint8, torch.float8_e5m2):
        tensors = {name: torch.zeros(8, 2, 8, dtype=dtype) for name in ("k", "v")}
        assert DevicePool(geom, [tensors]).num_pages == 2
    wrong = {name: torch.zeros(8, 2, 8, dtype=torch.bfloat16) for name in ("k", "v")}
    with pytest.raises(PoolShapeError) as info:
        DevicePool(geom, [wrong])
    assert str(info.value) == (
        "group 'full' layer 1 tensor 'k': dtype torch.bfloat16; expected torch.float8_e5m2 (or "
        "torch.uint8 holding its bytes); model.dtype sets the KV's, model.state_dtype and "
        "model.ssm_state_dtype the states'"
    )


def test_a_state_tensor_in_the_wrong_dtype_is_refused() -> None:
    geom = GroupGeometry.of(MAMBA, FP32_SSM, 16)
    layer = {"conv": torch.zeros(4, 6, 3, dtype=torch.bfloat16)}
    layer["ssm"] = torch.zeros(4, 2, 4, 5, dtype=torch.bfloat16)  # the engine's is float32
    with pytest.raises(
        PoolShapeError, match=r"tensor 'ssm': dtype torch\.bfloat16; expected torch\.float32;"
    ):
        DevicePool(geom, [layer, layer])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_mixed_dtype_group_round_trips_byte_exact(layout: str) -> None:
    geom = GroupGeometry.of(MAMBA, FP32_SSM, 16)
    backend = CpuCopyBackend(staging_bytes=4096)
    try:
        device = DevicePool.allocate(geom, 12, backend.device)
        gen = torch.Generator().manual_seed(3)
        for layer in device.tensors:
            layer["conv"].copy_(torch.randn(layer["conv"].shape, generator=gen))
            layer["ssm"].copy_(torch.randn(layer["ssm"].shape, generator=gen))
        before = [{n: t.clone() for n, t in layer.items()} for layer in device.tensors]
        host = HostPool(geom, 6, layout, backend.alloc_host(6 * geom.page_bytes))  # type: ignore[arg-type]
        rng = random.Random(layout)
        sources, host_pages = rng.sample(range(12), 4), [5, 0, 3, 1]
        targets = rng.sample([p for p in range(12) if p not in sources], 4)
        backup = GroupMove.build(backend, device, host, sources, host_pages)
        copy_layers_blocking(backend, Direction.BACKUP, [(backup, [0, 1])])
        load = GroupMove.build(backend, device, host, targets, host_pages)
        copy_layers_blocking(backend, Direction.LOAD, [(load, [0, 1])])
        for local_id, layer in enumerate(device.tensors):
            for name in ("conv", "ssm"):
                assert layer[name].dtype == geom.dtype_of(name)
                for s, t in zip(sources, targets, strict=True):
                    assert torch.equal(layer[name][t], before[local_id][name][s])
                untouched = [p for p in range(12) if p not in targets]
                assert torch.equal(layer[name][untouched], before[local_id][name][untouched])
    finally:
        backend.close()


def test_page_keys_differ_by_state_dtype_and_by_fp8_format() -> None:
    def namespace(dtypes: CacheDtypes, group: CacheGroup) -> bytes:
        geom = GroupGeometry.of(group, dtypes, 16)
        return Namespace(
            model="m",
            dtype=geom.dtype_signature,
            kv_layout=repr(group.spec),
            page_size_tokens=16,
            group=group.name,
            tp_rank=0,
            pp_rank=0,
            tenant_salt="",
        ).seed()

    bf16 = CacheDtypes.from_names("bfloat16")
    assert namespace(bf16, MAMBA) != namespace(FP32_SSM, MAMBA)
    e4m3, e5m2 = (
        CacheDtypes.from_names(f, state="bfloat16") for f in ("float8_e4m3fn", "float8_e5m2")
    )
    assert namespace(e4m3, FULL) != namespace(e5m2, FULL)


def test_real_hybrid_models_size_their_fp32_ssm_state() -> None:
    """Nemotron-H (mamba2) and Qwen3-Next (gated delta net): the SSM / recurrent state in
    float32 doubles those rows and nothing else."""
    for model in ("nemotron_h_8b.json", "qwen3_next_80b.json"):
        layer_map = LayerMap(load_layout(shared_model(model)))
        for group in layer_map.groups:
            plain = GroupGeometry.of(group, CacheDtypes.from_names("bfloat16"), 16)
            mixed = GroupGeometry.of(group, FP32_SSM, 16)
            for name, _ in plain.tensors:
                factor = 2 if not group.kind.is_token_cache and name != "conv" else 1
                assert mixed.row_bytes(name) == factor * plain.row_bytes(name), (model, name)
        assert any(not g.kind.is_token_cache for g in layer_map.groups), model
