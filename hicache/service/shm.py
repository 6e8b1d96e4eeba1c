"""Shared memory between an engine process and the sidecar: the engine's KV pool and the
per-load layer counters. Bytes never cross the socket; only a manifest of where they live.

Pool file (CPU data plane). The engine creates it (`SharedPools.create`) under the sidecar's
`service.shm_dir`: per cache group, per layer, per tensor one contiguous `[slots, *shape]`
tensor, each at a 4 KiB-aligned offset. `register_pools` sends the manifest (path, size, per
tensor offsets); the sidecar maps the same file (`map_pools`) after checking the file (a regular
file under shm_dir, ours, of the stated size) and every offset (in bounds, aligned, no two
tensors overlapping). The engine unlinks the file when it closes; a mapping outlives the name.

Counter file. The sidecar creates one per session: `slots` rows of six int64
`[load_id, layers_done, state, num_layers, landed_ns, stop]` (landed_ns: CLOCK_MONOTONIC when
the latest layer landed, so the engine can measure how late it saw it), then, per slot,
`CAUSE_BYTES` of UTF-8 (NUL-padded): why the load's walk stopped. A load's row is written
before its reply is sent; the copy thread bumps `layers_done` as layers land (stage-local
count); the op's end sets `state`. The engine's `wait_layer(i)` reads `layers_done > i` from its
own mapping — no message per layer, no syscall when the layer has landed.

A failed layer is written as a stop, as soon as the copy thread knows, before the load ends:
`layers_done` stays at the failed position k (it never passes a layer that did not land), the
cause text is written, then `stop` (a `StopKind` code: failed layer, cancelled, failed walk;
0 while none). `state` stays RUNNING until the op has really ended (its copies drained, its
pins released), so `done()` still means "ended"; only `wait_layer(i >= k)` changes: it sees
`stop` and raises at once. A load that ends failed or cancelled without its walk reporting a
stop (it never ran) gets one at `layers_done` from `end`, before its final state.

Aligned int64 stores are single writes on x86-64 and arm64, and each store follows the copy
(or the cause text) it reports in program order (x86-64 TSO; CUDA loads report after their
event).
"""

from __future__ import annotations

import itertools
import os
import secrets
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache.errors import PoolManifestError, PoolShapeError
from hicache.memory import DevicePool, GroupGeometry
from hicache.transfer import LayerFailure, StopKind

ALIGN_BYTES = 4096
COUNTER_FIELDS = 6  # load_id, layers_done, state, num_layers, landed_ns, stop
CAUSE_BYTES = 256  # per slot, after the rows: the stop's reason, UTF-8, NUL-padded


class LoadState(IntEnum):
    FREE = 0
    RUNNING = 1
    DONE = 2
    FAILED = 3
    CANCELLED = 4


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _tensor_bytes(geometry: GroupGeometry, num_pages: int, tensor: str) -> int:
    return num_pages * geometry.row_bytes(tensor)


def _create_file(directory: Path, prefix: str, nbytes: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return path


def _map(path: Path, nbytes: int) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


@dataclass
class SharedPools:
    """The engine's side: KV pools in one shared file, as tensors the engine computes with."""

    path: Path
    nbytes: int
    geometries: dict[str, GroupGeometry]
    num_pages: dict[str, int]
    offsets: dict[str, list[list[int]]]  # group -> layer -> offset per tensor (geometry order)
    buffer: torch.Tensor

    @classmethod
    def create(
        cls,
        geometries: Mapping[str, GroupGeometry],
        num_pages: int | Mapping[str, int],
        directory: Path | str = "/dev/shm",
    ) -> SharedPools:
        pages = {
            name: num_pages if isinstance(num_pages, int) else num_pages[name]
            for name in geometries
        }
        offsets: dict[str, list[list[int]]] = {}
        cursor = 0
        for name, geom in geometries.items():
            if pages[name] < 1:
                raise PoolShapeError(f"group {name!r}: num_pages {pages[name]} must be >= 1")
            offsets[name] = []
            for _ in range(geom.num_layers):
                row = []
                for tensor, _ in geom.tensors:
                    row.append(cursor)
                    cursor = _align(cursor + _tensor_bytes(geom, pages[name], tensor))
                offsets[name].append(row)
        nbytes = max(cursor, ALIGN_BYTES)
        path = _create_file(Path(directory), "hicache-pool", nbytes)
        return cls(path, nbytes, dict(geometries), pages, offsets, _map(path, nbytes))

    def manifest(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "nbytes": self.nbytes,
            "groups": {
                name: {"num_pages": self.num_pages[name], "offsets": self.offsets[name]}
                for name in self.geometries
            },
        }

    def device_pools(self) -> dict[str, DevicePool]:
        return _views(self.buffer, self.geometries, self.num_pages, self.offsets)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


def _views(
    buffer: torch.Tensor,
    geometries: Mapping[str, GroupGeometry],
    num_pages: Mapping[str, int],
    offsets: Mapping[str, Sequence[Sequence[int]]],
) -> dict[str, DevicePool]:
    pools = {}
    for name, geom in geometries.items():
        layers = []
        for layer_offsets in offsets[name]:
            tensors = {}
            for (tensor, shape), offset in zip(geom.tensors, layer_offsets, strict=True):
                size = _tensor_bytes(geom, num_pages[name], tensor)
                slots = num_pages[name] * geom.slots_per_page
                flat = buffer[offset : offset + size].view(geom.dtype_of(tensor))
                tensors[tensor] = flat.view(slots, *shape)
            layers.append(tensors)
        pools[name] = DevicePool(geom, layers)
    return pools


def map_pools(
    manifest: Mapping[str, Any], geometries: Mapping[str, GroupGeometry], shm_dir: Path
) -> dict[str, DevicePool]:
    """The sidecar's side: check the manifest against the file and the geometries, then map."""
    path = Path(manifest["path"])
    nbytes = manifest["nbytes"]
    root = shm_dir.resolve()
    resolved = path.resolve()
    if not resolved.is_relative_to(root):
        raise PoolManifestError(
            f"path {str(path)!r} is outside the shared-memory dir {str(root)!r}"
        )
    try:
        info = os.stat(resolved)
    except FileNotFoundError:
        raise PoolManifestError(f"path {str(path)!r} does not exist") from None
    if not stat.S_ISREG(info.st_mode):
        raise PoolManifestError(f"path {str(path)!r} is not a regular file")
    if info.st_uid != os.getuid():
        raise PoolManifestError(
            f"path {str(path)!r} belongs to uid {info.st_uid}, not {os.getuid()}"
        )
    if info.st_size != nbytes:
        raise PoolManifestError(f"nbytes {nbytes} does not match the file's size {info.st_size}")
    groups = manifest["groups"]
    if set(groups) != set(geometries):
        raise PoolManifestError(
            f"groups {sorted(groups)} given; the layout's groups are {sorted(geometries)}"
        )
    spans: list[tuple[int, int, str]] = []
    for name, geom in geometries.items():
        entry = groups[name]
        pages, offsets = entry["num_pages"], entry["offsets"]
        if len(offsets) != geom.num_layers:
            raise PoolManifestError(
                f"groups.{name}.offsets: {len(offsets)} layers; the group has {geom.num_layers}"
            )
        for local_id, layer_offsets in enumerate(offsets):
            if len(layer_offsets) != len(geom.tensors):
                raise PoolManifestError(
                    f"groups.{name}.offsets[{local_id}]: {len(layer_offsets)} tensors; "
                    f"expected {len(geom.tensors)} ({', '.join(t for t, _ in geom.tensors)})"
                )
            for (tensor, _), offset in zip(geom.tensors, layer_offsets, strict=True):
                where = f"groups.{name}.offsets[{local_id}] ({tensor})"
                size = _tensor_bytes(geom, pages, tensor)
                itemsize = geom.dtype_of(tensor).itemsize
                if offset % itemsize:
                    raise PoolManifestError(f"{where}: offset {offset} is not {itemsize}-aligned")
                if offset + size > nbytes:
                    raise PoolManifestError(
                        f"{where}: bytes {offset}..{offset + size} run past the file's {nbytes}"
                    )
                spans.append((offset, offset + size, where))
    spans.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            raise PoolManifestError(f"{second} overlaps {first}")
    buffer = _map(resolved, nbytes)
    pages_of = {name: groups[name]["num_pages"] for name in geometries}
    return _views(buffer, geometries, pages_of, {n: groups[n]["offsets"] for n in geometries})


class CounterFile:
    """Per-session load counters in shared memory (`slots` rows of six int64, then a cause
    text per slot)."""

    def __init__(
        self,
        path: Path,
        slots: int,
        array: np.ndarray[Any, np.dtype[np.int64]],
        causes: np.ndarray[Any, np.dtype[np.uint8]],
    ):
        self.path = path
        self.slots = slots
        self.array = array
        self.causes = causes
        self._tensor: torch.Tensor | None = None  # keeps the mapping alive

    @staticmethod
    def nbytes(slots: int) -> int:
        return max(slots * (COUNTER_FIELDS * 8 + CAUSE_BYTES), 8)

    @classmethod
    def create(cls, directory: Path, slots: int) -> CounterFile:
        path = _create_file(directory, "hicache-counters", cls.nbytes(slots))
        return cls.open(path, slots)

    @classmethod
    def open(cls, path: Path | str, slots: int) -> CounterFile:
        path = Path(path)
        tensor = _map(path, cls.nbytes(slots))
        raw = tensor.numpy()
        rows_end = slots * COUNTER_FIELDS * 8
        array = raw[:rows_end].view(np.int64).reshape(slots, COUNTER_FIELDS)
        causes = raw[rows_end : rows_end + slots * CAUSE_BYTES].reshape(slots, CAUSE_BYTES)
        counters = cls(path, slots, array, causes)
        counters._tensor = tensor
        return counters

    def start(self, slot: int, load_id: int, num_layers: int) -> None:
        row = self.array[slot]
        row[1] = 0
        row[3] = num_layers
        row[4] = 0
        row[5] = 0
        self.causes[slot] = 0
        row[2] = LoadState.RUNNING
        row[0] = load_id

    def stop(self, slot: int, failure: LayerFailure) -> None:
        """The load's walk stopped (the copy thread, before the op ends): the cause text, then
        the stop code; `layers_done` already holds `failure.position`."""
        text = failure.reason.encode()[:CAUSE_BYTES].decode(errors="ignore").encode()
        cause = self.causes[slot]
        cause[:] = 0
        cause[: len(text)] = np.frombuffer(text, dtype=np.uint8)
        self.array[slot][5] = failure.kind

    def end(self, slot: int, state: LoadState, reason: str) -> None:
        """The op ended (the event loop): a failed or cancelled load whose walk reported no
        stop (it never ran) gets one at `layers_done`, then `state` is set."""
        row = self.array[slot]
        if state is not LoadState.DONE and int(row[5]) == 0:
            kind = StopKind.CANCELLED if state is LoadState.CANCELLED else StopKind.FAILED_WALK
            self.stop(slot, LayerFailure(int(row[1]), kind, reason or state.name.lower()))
        row[2] = state

    def failure(self, slot: int) -> LayerFailure | None:
        """The stop a slot's row holds (read after `stop` was seen set), or None."""
        row = self.array[slot]
        code = int(row[5])
        if code == 0:
            return None
        reason = self.causes[slot].tobytes().rstrip(b"\0").decode(errors="replace")
        return LayerFailure(int(row[1]), StopKind(code), reason)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)
