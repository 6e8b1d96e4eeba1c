"""The CUDA data plane between an engine and the sidecar: the engine's pool tensors, exported as
CUDA IPC handles, mapped by the sidecar, which copies on its own streams (CudaCopyBackend).

Engine side: `export_cuda_pools(pools)` -> a manifest of plain values (msgpack-safe): per
group, per layer, per tensor the IPC handle of its allocation and the tensor's place in it
(what `torch.multiprocessing` sends, without pickling). Sidecar side: `map_cuda_pools`
rebuilds each tensor from its handle and wraps it in a `DevicePool`, which checks every shape
and dtype against the layout. The engine must keep its tensors alive while registered (CUDA
IPC maps the allocation, not a copy); the sidecar drops its mappings when the session ends.

Stores are ordered by a fence the engine sends (`export_fence`): an interprocess event
recorded on the engine's stream after the kernels that wrote the pages, whose IPC handle goes
in the store request; the sidecar opens it (`CudaCopyBackend.import_fence`) and its backup
stream waits on it, so nothing is read before the engine's writes land, and the engine never
synchronises. The engine keeps the event alive until the store's reply (the client keeps the
last few), since operations on an imported event whose exporter destroyed it are undefined.

Per-layer completion crosses the process boundary through the same shared-memory counter as
on CPU: the sidecar's completion thread waits each layer's event and bumps the counter, and the
engine's `wait_layer(i)` returns once it sees layer i — before it launches layer i's kernels,
so they are ordered after the copy. (A GPU-side wait on IPC events would let the engine queue
work earlier; see docs/design.md.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from hicache.errors import PoolManifestError
from hicache.memory import DevicePool, GroupGeometry
from hicache.memory.geometry import dtype_name


def _export(tensor: torch.Tensor) -> dict[str, Any]:
    if tensor.device.type != "cuda":
        raise PoolManifestError(f"a CUDA pool tensor is on {tensor.device}, not a CUDA device")
    storage = tensor.untyped_storage()
    (
        device,
        handle,
        size_bytes,
        offset_bytes,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = storage._share_cuda_()  # type: ignore[no-untyped-call]
    return {
        "device": int(device),
        "handle": bytes(handle),
        "storage_bytes": int(size_bytes),
        "storage_offset_bytes": int(offset_bytes),
        "ref_handle": bytes(ref_handle),
        "ref_offset": int(ref_offset),
        "event_handle": bytes(event_handle) if event_handle else b"",
        "event_sync": bool(event_sync),
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
        "offset": int(tensor.storage_offset()),
        "dtype": dtype_name(tensor.dtype),
    }


def export_cuda_pools(pools: Mapping[str, DevicePool]) -> dict[str, Any]:
    """The `register_cuda_pools` manifest of the engine's CUDA pools."""
    return {
        "groups": {
            name: {
                "num_pages": pool.num_pages,
                "tensors": [
                    [_export(layer[tensor]) for tensor, _ in pool.geometry.tensors]
                    for layer in pool.tensors
                ],
            }
            for name, pool in pools.items()
        }
    }


def pools_device(pools: Mapping[str, DevicePool]) -> torch.device:
    """The one CUDA device every pool tensor is on (refused when they are not all on one)."""
    devices = {
        t.device for pool in pools.values() for layer in pool.tensors for t in layer.values()
    }
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise PoolManifestError(
            f"the pools are on {sorted(str(d) for d in devices)}; register_cuda_pools needs "
            "every pool tensor on one CUDA device (one registration per device, i.e. per TP rank)"
        )
    return next(iter(devices))


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """The calling thread's current stream on `device` (an engine's compute stream, read on
    its own thread, for a store sent from another)."""
    return torch.cuda.current_stream(device)


def export_fence(
    device: torch.device, stream: torch.cuda.Stream | None = None
) -> tuple[torch.cuda.Event, bytes]:
    """On the engine's thread, after it enqueued the writes: an interprocess event recorded
    on `stream` (default: this thread's current stream on `device`) and its IPC handle, for a
    store request's `fence`. Keep the event alive until the store's reply."""
    target = torch.cuda.current_stream(device) if stream is None else stream
    event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
    event.record(target)
    return event, bytes(event.ipc_handle())  # type: ignore[no-untyped-call]


def _rebuild(entry: Mapping[str, Any], where: str) -> torch.Tensor:
    try:
        dtype = getattr(torch, str(entry["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype {entry['dtype']!r} is not a torch dtype")
        return rebuild_cuda_tensor(  # type: ignore[no-untyped-call,no-any-return]
            torch.Tensor,
            torch.Size(entry["shape"]),
            tuple(entry["stride"]),
            entry["offset"],
            torch.storage.UntypedStorage,
            dtype,
            entry["device"],
            entry["handle"],
            entry["storage_bytes"],
            entry["storage_offset_bytes"],
            False,
            entry["ref_handle"],
            entry["ref_offset"],
            entry["event_handle"] or None,
            entry["event_sync"],
        )
    except (RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise PoolManifestError(f"{where}: cannot open the CUDA IPC handle: {exc}") from None


def map_cuda_pools(
    manifest: Mapping[str, Any], geometries: Mapping[str, GroupGeometry]
) -> dict[str, DevicePool]:
    groups = manifest["groups"]
    if set(groups) != set(geometries):
        raise PoolManifestError(
            f"groups {sorted(groups)} given; the layout's groups are {sorted(geometries)}"
        )
    pools = {}
    for name, geom in geometries.items():
        layers = groups[name]["tensors"]
        if len(layers) != geom.num_layers:
            raise PoolManifestError(
                f"groups.{name}.tensors: {len(layers)} layers; the group has {geom.num_layers}"
            )
        rebuilt = []
        for local_id, entries in enumerate(layers):
            if len(entries) != len(geom.tensors):
                raise PoolManifestError(
                    f"groups.{name}.tensors[{local_id}]: {len(entries)} tensors; expected "
                    f"{len(geom.tensors)} ({', '.join(t for t, _ in geom.tensors)})"
                )
            rebuilt.append(
                {
                    tensor: _rebuild(entry, f"groups.{name}.tensors[{local_id}] ({tensor})")
                    for (tensor, _), entry in zip(geom.tensors, entries, strict=True)
                }
            )
        pools[name] = DevicePool(geom, rebuilt)
    return pools
