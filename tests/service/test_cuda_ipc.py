"""The CUDA data plane (needs a GPU): an engine's CUDA pools shared with a `device.kind: cuda`
sidecar by IPC handle; stores and layer-wise loads run on the sidecar's streams."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache.client import connect
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from hicache.demo.content import seeds_for
from hicache.memory import DevicePool
from tests.pages import split_store
from tests.service.conftest import write_config

pytestmark = pytest.mark.gpu


def fill(pool: DevicePool, page: int, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed & 0x7FFFFFFF)
    for local_id in range(pool.geometry.num_layers):
        for rows in pool.layer_rows(local_id):
            rows[page].copy_(
                torch.randint(
                    0, 256, rows[page].shape, dtype=torch.uint8, device="cuda", generator=gen
                )
            )


def test_cuda_pools_by_ipc_round_trip_byte_exact(tmp_path: Path) -> None:
    config = write_config(tmp_path, device="cuda")
    loaded = load_deployment(config)
    with SidecarProcess(config) as sidecar:
        client = connect(sidecar.socket, loaded.layer_map(), page_size_tokens=16)
        pools = {name: DevicePool.allocate(g, 32, "cuda") for name, g in client.geometries.items()}
        client.register_cuda_pools(pools)
        tokens = list(range(96))
        src = {
            n: list(range(6)) if g.group.kind.is_token_cache else [0]
            for n, g in client.geometries.items()
        }
        dst = {
            n: list(range(10, 16)) if g.group.kind.is_token_cache else [10]
            for n, g in client.geometries.items()
        }
        for name, g in client.geometries.items():
            for page, seed in zip(
                src[name], seeds_for(tokens, name, g.group.kind.is_token_cache, 16), strict=True
            ):
                fill(pools[name], page, seed)
        torch.cuda.synchronize()
        kinds = {n: g.group.kind for n, g in client.geometries.items()}
        assert client.store(tokens, *split_store(kinds, tokens, src, 16))["pages_stored"] == 7
        handle = client.load(tokens, dst)
        assert handle is not None
        for layer_id in client.layer_map.stage_layer_ids:
            handle.wait_layer(layer_id)
        assert handle.done() == "done"
        for name in pools:
            for local_id in range(pools[name].geometry.num_layers):
                for rows in pools[name].layer_rows(local_id):
                    for s, d in zip(src[name], dst[name], strict=True):
                        assert torch.equal(rows[s], rows[d])
        client.close()


def gpu_sleep(seconds: float) -> None:
    """Keep the current stream busy for about `seconds` (clock_rate is in kHz)."""
    rate = getattr(torch.cuda.get_device_properties(0), "clock_rate", 2_000_000)
    torch.cuda._sleep(int(seconds * rate * 1e3))  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("how", ["stream_argument", "current_stream"])
def test_a_store_waits_for_the_engines_kernels_without_a_sync(tmp_path: Path, how: str) -> None:
    """The engine writes the pages on a side stream behind a long kernel and stores at once,
    without synchronising: the sidecar's backup must wait on the engine's IPC event, so what
    L2 holds (and a load brings back) is the final bytes, not the zeros before them."""
    config = write_config(tmp_path, device="cuda")
    loaded = load_deployment(config)
    with SidecarProcess(config) as sidecar:
        client = connect(sidecar.socket, loaded.layer_map(), page_size_tokens=16)
        pools = {name: DevicePool.allocate(g, 32, "cuda") for name, g in client.geometries.items()}
        client.register_cuda_pools(pools)
        torch.cuda.synchronize()
        tokens = list(range(96))
        src = {
            n: list(range(6)) if g.group.kind.is_token_cache else [0]
            for n, g in client.geometries.items()
        }
        dst = {
            n: list(range(10, 16)) if g.group.kind.is_token_cache else [10]
            for n, g in client.geometries.items()
        }
        kinds = {n: g.group.kind for n, g in client.geometries.items()}
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(side):
            gpu_sleep(1.0)  # the engine's forward is still running...
            for name, g in client.geometries.items():  # ...and writes the pages last
                seeds = seeds_for(tokens, name, g.group.kind.is_token_cache, 16)
                for page, seed in zip(src[name], seeds, strict=True):
                    fill(pools[name], page, seed)
            if how == "current_stream":
                reply = client.store(tokens, *split_store(kinds, tokens, src, 16))
        if how == "stream_argument":
            reply = client.store(tokens, *split_store(kinds, tokens, src, 16), stream=side)
        assert reply["pages_stored"] == 7
        handle = client.load(tokens, dst)
        assert handle is not None
        for layer_id in client.layer_map.stage_layer_ids:
            handle.wait_layer(layer_id)
        assert handle.done() == "done"
        torch.cuda.synchronize()
        for name in pools:
            for local_id in range(pools[name].geometry.num_layers):
                for rows in pools[name].layer_rows(local_id):
                    for s, d in zip(src[name], dst[name], strict=True):
                        assert rows[s].any(), "the engine's writes never landed"
                        assert torch.equal(rows[s], rows[d]), (
                            "the sidecar backed up the pages before the engine's kernels wrote them"
                        )
        client.close()
