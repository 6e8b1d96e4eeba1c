"""Issue #36: the CUDA IPC manifest, on the CPU with a recording stand-in for torch's
`_share_cuda_` and `rebuild_cuda_tensor`. Finding 3: a pool is exported once and every later
registration (a retry, a reconnect's replay, another client) reuses that export, and the
sidecar maps it without torch's ref counter; finding 4: the GPU is named by identity and
resolved among the sidecar's own devices, refused by name when it sees no such GPU; finding
5: an expandable segment's handle is refused, at export and on the wire, naming
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`. The device side is in
tests/service/test_cuda_ipc.py."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from hicache.channel import protocol as p
from hicache.errors import PoolManifestError
from hicache.memory import DevicePool, GroupGeometry
from hicache.model import CacheKind, CacheSpec, KvFormat, LayerSpec, ModelLayout
from hicache.transfer import cuda_ipc

GPU_A = {"uuid": "GPU-aaaa", "pci_bus_id": "0000:3b:00.0", "index": 0}
GPU_B = {"uuid": "GPU-bbbb", "pci_bus_id": "0000:5e:00.0", "index": 1}


def geometry() -> GroupGeometry:
    spec = CacheSpec(CacheKind.FULL, KvFormat.MHA, num_kv_heads=1, head_dim=8, v_head_dim=8)
    layout = ModelLayout.build("tiny", [LayerSpec(0, (spec,)), LayerSpec(1, (spec,))])
    return GroupGeometry(layout.groups[0], torch.float16, 4)


class Shares:
    """Stands in for `_share_cuda_`: counts the exports, each with a fresh ref counter."""

    def __init__(self, handle_bytes: int = 66, mark: bytes = b"c") -> None:
        self.count = 0
        self.handle = b"\x02" + mark + b"h" * (handle_bytes - 2)

    def __call__(self, tensor: torch.Tensor, where: str) -> tuple[Any, ...]:
        self.count += 1
        size = tensor.untyped_storage().nbytes()
        return (0, self.handle, size, 0, f"/torch_ref_{self.count}".encode(), 0, b"e" * 64, True)


@pytest.fixture
def shares(monkeypatch: pytest.MonkeyPatch) -> Shares:
    made = Shares()
    monkeypatch.setattr(cuda_ipc, "_share", made)
    monkeypatch.setattr(cuda_ipc, "pools_device", lambda pools: torch.device("cuda", 0))
    monkeypatch.setattr(cuda_ipc, "device_identity", lambda device: dict(GPU_A))
    return made


# ---- finding 3: one export per pool ---------------------------------------------------------


def test_a_pool_is_exported_once_and_every_registration_reuses_it(shares: Shares) -> None:
    """On 7767ef8 each call exported again: one more CudaIPCSentData, ref counter and
    blocking interprocess event per tensor per attempt (vLLM retries every retry_after_s)."""
    pool = DevicePool.allocate(geometry(), 2)
    first = cuda_ipc.export_cuda_pools({"full": pool})
    tensors = 2 * len(pool.geometry.tensors)  # two layers
    assert shares.count == tensors
    for _ in range(5):  # retries, a reconnect's replay, another client of this process
        assert cuda_ipc.export_cuda_pools({"full": pool}) == first
    assert shares.count == tensors
    assert first["device"] == GPU_A
    assert p.RegisterCudaPools.model_validate({**first, "counters_fd": 3}).device.uuid == "GPU-aaaa"


def test_a_new_pool_gets_its_own_export_and_a_freed_one_is_forgotten(shares: Shares) -> None:
    pool = DevicePool.allocate(geometry(), 2)
    cuda_ipc.export_cuda_pools({"full": pool})
    other = DevicePool.allocate(geometry(), 2)
    cuda_ipc.export_cuda_pools({"full": other})
    assert shares.count == 2 * 2 * len(pool.geometry.tensors)
    del pool, other
    gc.collect()
    assert len(cuda_ipc._exports) == 0


def test_the_sidecar_maps_without_torchs_ref_counter_on_its_own_index(
    shares: Shares, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replayed export would be released once per mapping session (at a cache hit at once),
    driving the engine's counter to 0 while a session still maps the memory: the sidecar
    leaves it alone. The GPU is the one the engine named, at the sidecar's index for it."""
    pool = DevicePool.allocate(geometry(), 2)
    manifest = cuda_ipc.export_cuda_pools({"full": pool})
    rebuilt: list[tuple[Any, ...]] = []

    def rebuild(*args: Any) -> torch.Tensor:
        rebuilt.append(args)
        size, stride, dtype = args[1], args[2], args[5]
        return torch.empty_strided(size, stride, dtype=dtype)

    monkeypatch.setattr(cuda_ipc, "rebuild_cuda_tensor", rebuild)
    monkeypatch.setattr(cuda_ipc, "visible_devices", lambda: [dict(GPU_B), dict(GPU_A)])
    pools = cuda_ipc.map_cuda_pools(manifest, {"full": pool.geometry})
    assert pools["full"].num_pages == 2
    assert {args[6] for args in rebuilt} == {1}  # GPU_A is the sidecar's cuda:1
    assert {(args[11], args[12]) for args in rebuilt} == {(b"", 0)}  # no ref counter


# ---- finding 4: the GPU by identity ---------------------------------------------------------


@pytest.mark.parametrize(
    ("visible", "index"),
    [([GPU_A, GPU_B], 0), ([GPU_B, GPU_A], 1)],
    ids=["same order", "CUDA_VISIBLE_DEVICES reversed"],
)
def test_the_engines_gpu_resolves_to_the_sidecars_index_for_it(
    visible: list[dict[str, Any]], index: int
) -> None:
    assert cuda_ipc.resolve_device(GPU_A, visible) == index


def test_a_gpu_named_by_pci_bus_id_alone_resolves_by_it() -> None:
    wanted = {"uuid": "", "pci_bus_id": GPU_B["pci_bus_id"], "index": 0}
    assert cuda_ipc.resolve_device(wanted, [GPU_A, GPU_B]) == 1


def test_a_gpu_the_sidecar_does_not_see_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On 7767ef8 the engine's index was mapped as is: the pool opened on whichever GPU has
    that index here, and every byte crossed the peer link. A UUID decides alone (a PCI id
    match on another host's GPU is not the same GPU)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    wanted = {**GPU_A, "pci_bus_id": GPU_B["pci_bus_id"]}
    with pytest.raises(PoolManifestError) as refused:
        cuda_ipc.resolve_device(wanted, [GPU_B])
    assert str(refused.value) == (
        "device: the engine's pools are on GPU GPU-aaaa (PCI 0000:5e:00.0, the engine's "
        "cuda:0), which this sidecar does not see (CUDA_VISIBLE_DEVICES=1; it sees cuda:0 "
        "GPU-bbbb (PCI 0000:5e:00.0)): give the sidecar that GPU, e.g. the same "
        "CUDA_VISIBLE_DEVICES as the engine's"
    )
    with pytest.raises(PoolManifestError, match=r"it sees no GPU\)"):
        cuda_ipc.resolve_device(GPU_A, [])


def test_the_pci_bus_id_is_written_as_cuda_writes_it() -> None:
    props = type("Props", (), {"pci_domain_id": 0, "pci_bus_id": 0x3B, "pci_device_id": 0})()
    assert cuda_ipc.pci_bus_id(props) == "0000:3b:00.0"
    assert cuda_ipc.pci_bus_id(object()) == ""  # a torch without them: the UUID decides


# ---- finding 5: expandable segments ---------------------------------------------------------


@pytest.mark.parametrize("handle", ["kilobytes", "expandable mark"])
def test_an_expandable_segments_handle_is_refused_at_export_naming_the_setting(
    shares: Shares, handle: str
) -> None:
    # torch's shareable handle: a version byte, a type byte ("e": an expandable segment)
    shares.handle = b"\x02c" + b"h" * 3000 if handle == "kilobytes" else b"\x02e" + b"h" * 80
    with pytest.raises(PoolManifestError) as refused:
        cuda_ipc.export_cuda_pools({"full": DevicePool.allocate(geometry(), 2)})
    message = str(refused.value)
    assert message.startswith("groups.full.tensors[0] (k): its CUDA IPC handle is ")
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in message
    assert "start the engine without it (unset it, or expandable_segments:False)" in message
    assert len(cuda_ipc._exports) == 0  # nothing kept of a refused export


def test_the_wire_refuses_a_long_handle_naming_the_setting() -> None:
    entry = {
        "device": 0,
        "handle": b"h" * 3000,
        "storage_bytes": 64,
        "storage_offset_bytes": 0,
        "ref_handle": b"",
        "ref_offset": 0,
        "event_handle": b"",
        "event_sync": False,
        "shape": [4],
        "stride": [1],
        "offset": 0,
        "dtype": "float16",
    }
    with pytest.raises(ValidationError, match=r"expandable_segments:True"):
        p.CudaTensor.model_validate(entry)
    assert p.CudaTensor.model_validate({**entry, "handle": b"h" * 66}).handle == b"h" * 66
    assert p.IPC_MEM_HANDLE_MAX_BYTES == cuda_ipc.IPC_MEM_HANDLE_MAX_BYTES


def test_a_cudamalloc_handle_passes_in_either_format() -> None:
    cuda_ipc.check_handle(b"\x02c" + b"h" * 64, "t")  # torch's versioned format
    cuda_ipc.check_handle(b"\x01e" + b"h" * 62, "t")  # a bare cudaIpcMemHandle_t: no type byte
