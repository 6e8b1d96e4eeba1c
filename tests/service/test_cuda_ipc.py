"""The CUDA data plane (needs a GPU): an engine's CUDA pools shared with a `device.kind: cuda`
sidecar by IPC handle; stores and layer-wise loads run on the sidecar's streams; one export
per pool reused by every registration, the GPU resolved by identity, expandable segments
refused (issue #36; their CPU side: tests/transfer/test_cuda_ipc_manifest.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


# ---- issue #36 on a device ------------------------------------------------------------------


def round_trip(client: Any, pools: dict[str, DevicePool], first_token: int) -> None:
    """Store pages 0..5 (0 for state groups) of a fresh prompt, load them into 10..15, and
    check the bytes: the registration works end to end."""
    tokens = list(range(first_token, first_token + 96))
    src = {
        n: list(range(6)) if g.group.kind.is_token_cache else [0]
        for n, g in client.geometries.items()
    }
    dst = {
        n: list(range(10, 16)) if g.group.kind.is_token_cache else [10]
        for n, g in client.geometries.items()
    }
    for name, g in client.geometries.items():
        seeds = seeds_for(tokens, name, g.group.kind.is_token_cache, 16)
        for page, seed in zip(src[name], seeds, strict=True):
            fill(pools[name], page, seed)
    torch.cuda.synchronize()
    kinds = {n: g.group.kind for n, g in client.geometries.items()}
    assert client.store(tokens, *split_store(kinds, tokens, src, 16))["pages_stored"] == 7
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
                    assert torch.equal(rows[s], rows[d])


def test_registrations_after_the_first_reuse_its_export(tmp_path: Path) -> None:
    """Finding 3: a second client (as vLLM's worker makes after a failed attempt) registers
    the same pools, then the first client's connection drops and it reconnects (replaying
    its registration): one export per tensor in all, every registration maps, and the
    sidecar's mappings (its torch cache hit included, with no ref counter) copy right."""
    from hicache.transfer import cuda_ipc

    config = write_config(tmp_path, device="cuda")
    loaded = load_deployment(config)
    with SidecarProcess(config) as sidecar:
        first = connect(sidecar.socket, loaded.layer_map(), page_size_tokens=16)
        pools = {name: DevicePool.allocate(g, 32, "cuda") for name, g in first.geometries.items()}
        first.register_cuda_pools(pools)
        manifest = cuda_ipc.export_cuda_pools(pools)
        round_trip(first, pools, 0)
        first.close()
        second = connect(sidecar.socket, loaded.layer_map(), page_size_tokens=16)
        second.register_cuda_pools(pools)
        assert cuda_ipc.export_cuda_pools(pools) == manifest  # the same export, not a new one
        round_trip(second, pools, 1000)
        assert second._sock is not None
        second._sock.close()  # the connection drops: the next call reconnects and replays
        round_trip(second, pools, 2000)
        second.close()


VISIBLE = """
import json, sys
import torch
from hicache.transfer import cuda_ipc
wanted = json.loads(sys.argv[1])
index = cuda_ipc.resolve_device(wanted, cuda_ipc.visible_devices())
print(json.dumps({"index": index, "me": cuda_ipc.device_identity(torch.device("cuda", index))}))
"""


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_two_visible_device_orders_resolve_to_the_same_gpu() -> None:
    """Finding 4: the engine's cuda:0 seen from a process whose CUDA_VISIBLE_DEVICES lists
    the GPUs the other way round is its cuda:1 — the same UUID — and a process that does
    not see that GPU refuses it by name."""
    import json
    import os
    import subprocess
    import sys

    from hicache.transfer import cuda_ipc

    wanted = cuda_ipc.device_identity(torch.device("cuda", 0))
    order = [str(i) for i in range(torch.cuda.device_count())]

    def resolve(visible: list[str]) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(visible)}
        return subprocess.run(
            [sys.executable, "-c", VISIBLE, json.dumps(wanted)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    for visible, index in ((order, 0), (list(reversed(order)), len(order) - 1)):
        done = resolve(visible)
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        assert seen["index"] == index
        assert seen["me"]["uuid"] == wanted["uuid"]
    refused = resolve(order[1:])
    assert refused.returncode != 0
    assert f"on GPU {wanted['uuid']}" in refused.stderr
    assert "which this sidecar does not see" in refused.stderr


def test_expandable_segments_are_refused_at_export_naming_the_setting() -> None:
    """Finding 5, with torch's real handles: an engine allocating from expandable segments
    is refused before anything is sent, naming the setting; without it the export passes."""
    import os
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from hicache.memory import DevicePool\n"
        "from hicache.memory import GroupGeometry\n"
        "from hicache.model import CacheKind, CacheSpec, KvFormat, LayerSpec, ModelLayout\n"
        "spec = CacheSpec(CacheKind.FULL, KvFormat.MHA, num_kv_heads=8, head_dim=128)\n"
        "layout = ModelLayout.build('m', [LayerSpec(0, (spec,)), LayerSpec(1, (spec,))])\n"
        "geometry = lambda: GroupGeometry(layout.groups[0], torch.bfloat16, 16)\n"
        "from hicache.transfer import cuda_ipc\n"
        "pool = DevicePool.allocate(geometry(), 256, 'cuda')\n"
        "cuda_ipc.export_cuda_pools({'full': pool})\n"
        "print('exported')\n"
    )
    for conf, ok in (("expandable_segments:True", False), ("expandable_segments:False", True)):
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
        )
        if ok:
            assert done.returncode == 0, done.stderr
            assert "exported" in done.stdout
        else:
            assert done.returncode != 0
            assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in done.stderr
