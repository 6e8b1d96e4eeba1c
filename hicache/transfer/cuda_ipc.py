"""The CUDA data plane between an engine and the sidecar: the engine's pool tensors, exported as
CUDA IPC handles, mapped by the sidecar, which copies on its own streams (CudaCopyBackend).

Engine side: `export_cuda_pools(pools)` -> a manifest of plain values (msgpack-safe): the GPU
the pools are on, by identity (`device_identity`: UUID and PCI bus id, with the engine's own
index for messages), and per group, per layer, per tensor the IPC handle of its allocation
and the tensor's place in it (what `torch.multiprocessing` sends, without pickling).
Sidecar side: `map_cuda_pools` resolves that GPU among its own visible devices
(`resolve_device`: engine and sidecar may see different `CUDA_VISIBLE_DEVICES`, in
containers usually; a GPU it does not see is refused by name, never mapped on whatever
device has the engine's index), rebuilds each tensor from its handle and wraps it in a
`DevicePool`, which checks every shape and dtype against the layout.

An export's lifecycle: made once per pool (`DevicePool`), on its first registration, and
reused by every later one — a registration retried every few seconds, a reconnect's replay,
another client of the same process: each `_share_cuda_` adds a `CudaIPCSentData`, a ref
counter and a blocking interprocess event, and past torch's 1,000 events every export
synchronises the engine's stream. The export is forgotten with its pool. torch's ref counter
(one per export, starting at 1) is left to the engine: the sidecar maps without it, so
however many sessions map one export, none can drive it to 0 while another still maps the
memory; the engine's freed pool memory therefore stays with torch (its "limbo") until the
process exits, never handed back to its allocator under a sidecar's mapping. The engine must
keep its tensors alive while registered (CUDA IPC maps the allocation, not a copy); the
sidecar drops its mappings when the session ends.

Refused at export, before anything is sent: an allocation from expandable segments
(`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`), whose handle is a list of per-segment
shareable handles — kilobytes, beyond the wire's `IPC_MEM_HANDLE_MAX_BYTES` — that the
sidecar could only open by fetching the engine's file descriptors (pidfd_getfd: ptrace
rights, which a sidecar in another container lacks).

Stores are ordered by a fence the engine sends (`export_fence`): an interprocess event
recorded on the engine's stream after the kernels that wrote the pages, whose IPC handle goes
in the store request; the sidecar opens it (`CudaCopyBackend.import_fence`) and its backup
stream waits on it, so nothing is read before the engine's writes land, and the engine never
synchronises. The engine keeps the event alive while the sidecar may still use it (a store's
until its reply, a load's until the load ended, one with no reply until its session was
confirmed over: client/base.py `_engine_fence`), since operations on an imported event whose
exporter destroyed it are undefined.

Per-layer completion crosses the process boundary through the same shared-memory counter as
on CPU: the sidecar's completion thread waits each layer's event and bumps the counter, and the
engine's `wait_layer(i)` returns once it sees layer i — before it launches layer i's kernels,
so they are ordered after the copy. (A GPU-side wait on IPC events would let the engine queue
work earlier; see docs/design.md.)
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from hicache.errors import PoolManifestError
from hicache.memory import DevicePool, GroupGeometry
from hicache.memory.geometry import dtype_name

IPC_MEM_HANDLE_MAX_BYTES = 256  # the wire's cap (protocol.CudaTensor.handle)
EXPANDABLE_SEGMENTS = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
_EXPANDABLE_MARK = ord("e")  # torch's shareable-handle type byte for an expandable segment
_BARE_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def check_handle(handle: bytes, where: str) -> None:
    """Refuse a storage's IPC handle the sidecar cannot open, naming the setting behind it."""
    # torch's versioned format (a version byte, a type byte, the payload); a bare 64-byte
    # cudaIpcMemHandle_t (older torch) has no type byte to read
    versioned = len(handle) != _BARE_HANDLE_BYTES and len(handle) > 1 and handle[0] < 16
    expandable = versioned and handle[1] == _EXPANDABLE_MARK
    if expandable or len(handle) > IPC_MEM_HANDLE_MAX_BYTES:
        raise PoolManifestError(
            f"{where}: its CUDA IPC handle is {len(handle)} bytes"
            f"{' from an expandable segment' if expandable else ''} (at most "
            f"{IPC_MEM_HANDLE_MAX_BYTES}, one cudaMalloc allocation's): the engine allocates "
            f"with {EXPANDABLE_SEGMENTS}, whose memory the sidecar cannot map; start the "
            "engine without it (unset it, or expandable_segments:False)"
        )


def _share(tensor: torch.Tensor, where: str) -> tuple[Any, ...]:
    """`_share_cuda_` of the tensor's storage (the one export of it)."""
    if tensor.device.type != "cuda":
        raise PoolManifestError(f"{where}: on {tensor.device}, not a CUDA device")
    try:
        return tuple(tensor.untyped_storage()._share_cuda_())  # type: ignore[no-untyped-call]
    except RuntimeError as exc:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get(
            "PYTORCH_ALLOC_CONF", ""
        )
        hint = (
            f"; the engine allocates with {EXPANDABLE_SEGMENTS}, whose memory the sidecar "
            "cannot map: start the engine without it"
            if "expandable_segments:true" in conf.replace(" ", "").lower()
            else ""
        )
        raise PoolManifestError(
            f"{where}: torch cannot export it by IPC handle: {exc}{hint}"
        ) from None


def _export(tensor: torch.Tensor, where: str) -> dict[str, Any]:
    (
        device,
        handle,
        size_bytes,
        offset_bytes,
        ref_handle,
        ref_offset,
        event_handle,
        event_sync,
    ) = _share(tensor, where)
    check_handle(bytes(handle), where)
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


# a pool's export, made once and kept while the pool lives (weakly keyed: a new pool, even at
# a freed one's address, gets its own)
_exports: weakref.WeakKeyDictionary[DevicePool, dict[str, Any]] = weakref.WeakKeyDictionary()


def _pool_export(name: str, pool: DevicePool) -> dict[str, Any]:
    made = _exports.get(pool)
    if made is None:
        made = {
            "num_pages": pool.num_pages,
            "tensors": [
                [
                    _export(layer[tensor], f"groups.{name}.tensors[{local_id}] ({tensor})")
                    for tensor, _ in pool.geometry.tensors
                ]
                for local_id, layer in enumerate(pool.tensors)
            ],
        }
        _exports[pool] = made
    return made


def device_identity(device: torch.device) -> dict[str, Any]:
    """The GPU behind `device` as any process can name it: its UUID and PCI bus id (and this
    process's index for it, for messages only)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "uuid": str(getattr(props, "uuid", "")),
        "pci_bus_id": pci_bus_id(props),
        "index": index,
    }


def pci_bus_id(props: Any) -> str:
    """`domain:bus:device.0` as cudaDeviceGetPCIBusId writes it ("" where torch lacks it)."""
    try:
        domain, bus, dev = (int(getattr(props, f"pci_{k}_id")) for k in ("domain", "bus", "device"))
    except (AttributeError, TypeError, ValueError):
        return ""
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def export_cuda_pools(pools: Mapping[str, DevicePool]) -> dict[str, Any]:
    """The `register_cuda_pools` manifest of the engine's CUDA pools (each pool exported once,
    on its first call; refused, naming the setting, for expandable segments)."""
    groups = {name: _pool_export(name, pool) for name, pool in pools.items()}
    return {"device": device_identity(pools_device(pools)), "groups": groups}


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
    store's or load's `fence`. Keep the event alive while the sidecar may still use it
    (`ClientBase._engine_fence` says how long)."""
    target = torch.cuda.current_stream(device) if stream is None else stream
    event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
    event.record(target)
    return event, bytes(event.ipc_handle())  # type: ignore[no-untyped-call]


def visible_devices() -> list[dict[str, Any]]:
    """This process's CUDA devices by identity, in its own index order."""
    return [device_identity(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]


def resolve_device(wanted: Mapping[str, Any], visible: Sequence[Mapping[str, Any]]) -> int:
    """This process's index of the GPU `wanted` names (its UUID, else its PCI bus id);
    refused, naming the GPU and what this process sees, when it is not among `visible`."""
    for key in ("uuid", "pci_bus_id"):
        value = str(wanted.get(key) or "")
        if value:
            for index, device in enumerate(visible):
                if str(device.get(key) or "") == value:
                    return index
            break  # a UUID decides alone: PCI ids repeat across hosts and VMs
    seen = ", ".join(
        f"cuda:{i} {d.get('uuid') or '?'} (PCI {d.get('pci_bus_id') or '?'})"
        for i, d in enumerate(visible)
    )
    raise PoolManifestError(
        f"device: the engine's pools are on GPU {wanted.get('uuid') or '?'} (PCI "
        f"{wanted.get('pci_bus_id') or '?'}, the engine's cuda:{wanted.get('index', '?')}), "
        f"which this sidecar does not see (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}; it sees {seen or 'no GPU'}): "
        "give the sidecar that GPU, e.g. the same CUDA_VISIBLE_DEVICES as the engine's"
    )


def _rebuild(entry: Mapping[str, Any], where: str, device: int) -> torch.Tensor:
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
            device,  # the engine's GPU as this process numbers it
            entry["handle"],
            entry["storage_bytes"],
            entry["storage_offset_bytes"],
            False,
            b"",  # no ref counter: the engine's stays at 1 (the module docstring says why)
            0,
            entry["event_handle"] or None,
            entry["event_sync"],
        )
    except (RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise PoolManifestError(f"{where}: cannot open the CUDA IPC handle: {exc}") from None


def map_cuda_pools(
    manifest: Mapping[str, Any], geometries: Mapping[str, GroupGeometry]
) -> dict[str, DevicePool]:
    """The engine's pools, mapped on this process's index of the engine's GPU."""
    device = resolve_device(manifest["device"], visible_devices())
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
                    tensor: _rebuild(entry, f"groups.{name}.tensors[{local_id}] ({tensor})", device)
                    for (tensor, _), entry in zip(geom.tensors, entries, strict=True)
                }
            )
        pools[name] = DevicePool(geom, rebuilt)
    return pools
