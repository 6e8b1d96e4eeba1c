"""Byte-exact page copies through every backend: destination equals source, the source is
unchanged, and pages outside the op keep their old contents. Every cache shape (MHA K/V, MLA
latent, sparse index K and index K+V, linear / mamba / conv state), many dtypes, both host
layouts, random page sets (runs and scattered) and layer subsets. The same cases run on CUDA
when a device is present (marked `gpu`)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from hicache.memory import DevicePool, GroupGeometry, HostPool
from hicache.model import CacheGroup, CacheKind, CacheSpec, IndexSpec, KvFormat, load_layout
from hicache.transfer import (
    CopyBackend,
    CpuCopyBackend,
    Direction,
    GroupMove,
    copy_layers_blocking,
)
from tests.conftest import shared_model

SPECS = {
    "mha": CacheSpec(CacheKind.FULL, KvFormat.MHA, num_kv_heads=2, head_dim=8, v_head_dim=8),
    "k_only": CacheSpec(CacheKind.FULL, KvFormat.MHA, num_kv_heads=1, head_dim=16),
    "mla": CacheSpec(CacheKind.FULL, KvFormat.MLA, num_kv_heads=1, head_dim=36),
    "sparse_k": CacheSpec(
        CacheKind.SPARSE, KvFormat.MLA, num_kv_heads=1, head_dim=36, index=IndexSpec(8)
    ),
    "sparse_kv": CacheSpec(
        CacheKind.SPARSE,
        KvFormat.MHA,
        num_kv_heads=2,
        head_dim=8,
        v_head_dim=8,
        index=IndexSpec(4, has_v=True),
    ),
    "linear": CacheSpec(
        CacheKind.LINEAR, state_shapes=(("conv", (12, 3)), ("recurrent", (2, 4, 4)))
    ),
    "mamba": CacheSpec(CacheKind.MAMBA, state_shapes=(("conv", (10, 3)), ("ssm", (3, 2, 5)))),
    "conv": CacheSpec(CacheKind.CONV, state_shapes=(("conv", (16, 3)),)),
}
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8, torch.float64]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest) -> Iterator[CopyBackend]:
    if request.param == "cuda":
        from hicache.transfer.cuda_backend import CudaCopyBackend

        made: CopyBackend = CudaCopyBackend(0, staging_bytes=16 * 2**20)
    else:
        made = CpuCopyBackend(staging_bytes=4096)  # small: exercises chunked staging
    yield made
    made.close()


def fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    t.view(-1).view(torch.uint8).copy_(raw.to(t.device))


def make_pools(
    spec: CacheSpec,
    dtype: torch.dtype,
    layout: str,
    backend: CopyBackend,
    layers: int = 3,
    device_pages: int = 24,
    host_pages: int = 20,
    page_size: int = 4,
    seed: int = 0,
) -> tuple[DevicePool, HostPool]:
    group = CacheGroup("g", spec, tuple(range(0, 2 * layers, 2)))  # holey global ids
    geometry = GroupGeometry(group, dtype, page_size)
    device = DevicePool.allocate(geometry, device_pages, backend.device)
    host = HostPool(
        geometry, host_pages, layout, backend.alloc_host(host_pages * geometry.page_bytes)
    )  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    for tensors in device.tensors:
        for t in tensors.values():
            fill_random(t, gen)
    fill_random(host.buffer, gen)
    return device, host


def snapshot(
    device: DevicePool, host: HostPool
) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    return [
        {n: t.clone().cpu() for n, t in layer.items()} for layer in device.tensors
    ], host.buffer.clone()


def page_sets(
    rng: random.Random, n: int, device_pages: int, host_pages: int
) -> list[tuple[list[int], list[int]]]:
    runs = [list(range(3, 3 + n)), rng.sample(range(device_pages), n)]
    hosts = [list(range(5, 5 + n)), rng.sample(range(host_pages), n)]
    return [(d, h) for d in runs for h in hosts]


def check(
    direction: Direction,
    device: DevicePool,
    host: HostPool,
    before: tuple[list[dict[str, torch.Tensor]], torch.Tensor],
    dev_pages: list[int],
    host_pages: list[int],
    layers: list[int],
) -> None:
    old_dev, old_host_buf = before
    geometry = device.geometry
    for local_id in range(geometry.num_layers):
        for name, _ in geometry.tensors:
            dev_now = device.rows(local_id, name).cpu()
            host_now = host.rows(local_id, name).cpu()
            dev_old = DevicePool(geometry, old_dev).rows(local_id, name)
            host_old = HostPool(geometry, host.num_pages, host.layout, old_host_buf).rows(
                local_id, name
            )
            moved = local_id in layers
            for d, h in zip(dev_pages, host_pages, strict=True):
                if direction is Direction.LOAD:
                    want = host_old[h] if moved else dev_old[d]
                    assert torch.equal(dev_now[d], want), (name, local_id, d, h)
                else:
                    want = dev_old[d] if moved else host_old[h]
                    assert torch.equal(host_now[h], want), (name, local_id, d, h)
            # everything else unchanged: the source side entirely, the other pages of the target
            untouched_dev = [
                p
                for p in range(device.num_pages)
                if direction is Direction.BACKUP or not moved or p not in dev_pages
            ]
            untouched_host = [
                p
                for p in range(host.num_pages)
                if direction is Direction.LOAD or not moved or p not in host_pages
            ]
            assert torch.equal(dev_now[untouched_dev], dev_old[untouched_dev])
            assert torch.equal(host_now[untouched_host], host_old[untouched_host])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("direction", [Direction.LOAD, Direction.BACKUP])
def test_every_shape_both_layouts(
    backend: CopyBackend, spec_name: str, layout: str, direction: Direction
) -> None:
    rng = random.Random(hash((spec_name, layout, direction.value)) & 0xFFFF)
    device, host = make_pools(SPECS[spec_name], torch.bfloat16, layout, backend)
    for dev_pages, host_pages in page_sets(rng, 7, device.num_pages, host.num_pages):
        layers = sorted(rng.sample(range(3), rng.randint(1, 3)))
        before = snapshot(device, host)
        move = GroupMove.build(backend, device, host, dev_pages, host_pages)
        copy_layers_blocking(backend, direction, [(move, layers)])
        check(direction, device, host, before, dev_pages, host_pages, layers)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_every_dtype_round_trip(backend: CopyBackend, dtype: torch.dtype, layout: str) -> None:
    rng = random.Random(7)
    device, host = make_pools(
        SPECS["mha"], dtype, layout, backend, page_size=1, device_pages=64, host_pages=48
    )
    dev_pages = rng.sample(range(64), 20)
    host_pages = host.allocator.alloc(20)
    original = [{n: t.clone() for n, t in layer.items()} for layer in device.tensors]
    copy_layers_blocking(
        backend,
        Direction.BACKUP,
        [(GroupMove.build(backend, device, host, dev_pages, host_pages), [0, 1, 2])],
    )
    for layer in device.tensors:  # the engine reuses the slots
        for t in layer.values():
            t.zero_()
    new_pages = rng.sample(range(64), 20)
    copy_layers_blocking(
        backend,
        Direction.LOAD,
        [(GroupMove.build(backend, device, host, new_pages, host_pages), [0, 1, 2])],
    )
    for local_id, layer in enumerate(device.tensors):
        for name, t in layer.items():
            for old, new in zip(dev_pages, new_pages, strict=True):
                assert torch.equal(
                    t[new].view(torch.uint8), original[local_id][name][old].view(torch.uint8)
                )


@pytest.mark.parametrize(
    "model",
    [
        "gemma3_27b.json",
        "qwen3_next_80b.json",
        "falcon_h1_7b.json",
        "deepseek_v32_exp.json",
        "nemotron_h_8b.json",
    ],
)
def test_hybrid_models_move_only_the_groups_of_the_op(backend: CopyBackend, model: str) -> None:
    layout = load_layout(shared_model(model))
    rng = random.Random(model)
    pools = {}
    for group in layout.groups:
        geometry = GroupGeometry(group, torch.bfloat16, 2)
        device = DevicePool.allocate(geometry, 6, backend.device)
        host = HostPool(geometry, 5, "page_first", backend.alloc_host(5 * geometry.page_bytes))
        gen = torch.Generator().manual_seed(1)
        for layer in device.tensors:
            for t in layer.values():
                fill_random(t, gen)
        pools[group.name] = (device, host)
    moved = layout.groups[0].name  # one group moves; the other groups' host pages stay as they were
    host_before = {name: host.buffer.clone() for name, (_, host) in pools.items()}
    device, host = pools[moved]
    dev_pages, host_pages = rng.sample(range(6), 3), rng.sample(range(5), 3)
    layers = list(range(device.geometry.num_layers))
    before = snapshot(device, host)
    copy_layers_blocking(
        backend,
        Direction.BACKUP,
        [(GroupMove.build(backend, device, host, dev_pages, host_pages), layers)],
    )
    check(Direction.BACKUP, device, host, before, dev_pages, host_pages, layers)
    for name, (_, other) in pools.items():
        if name != moved:
            assert torch.equal(other.buffer, host_before[name])
