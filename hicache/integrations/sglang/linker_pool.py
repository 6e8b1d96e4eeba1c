"""SGLang's device KV pool (`MHATokenToKVPool`) as the pool the sidecar copies into: no staging.
No sglang import: it reads the pool's tensors (`k_buffer` / `v_buffer`, one per layer,
`[slots, heads, head_dim]`, token-slot rows in SGLang's "nhd" layout) and `page_size`.

A hicache page of the full-attention group is one SGLang page: for each layer, the K rows of
its `page_size` slots, then the V rows; slot s of page p is `p * page_size + s`, so page p's K
bytes are one contiguous run at `p * page_size * row_bytes` of the layer's K tensor. Every
layer's K and V tensors thus become hicache pool rows at an offset and a page stride
(`SharedPools.page_strides`); the geometry (heads, head dim, dtype, page size) is checked
against the sidecar's, tensor by tensor, and a mismatch is refused naming both sides.

CPU: the tensors' allocations (SGLang keeps one per layer, K and V its halves) are backed by a
sealed memfd in place (`core.shared_memory.share_in_place`). Where an allocation cannot be
shared in place (a heap chunk sharing its edge pages), `reback` gives the pool new tensors
over a memfd of its own, the same shapes and strides, the bytes copied: done once, before the
engine computes, and SGLang's cached pointer tables are rebuilt (`refresh`). CUDA: the tensors
are registered by IPC handle (`device_pools`).

An SWA model's pool (`SWAKVPool`) is two MHA pools: `full_kv_pool` (the full-attention layers)
and `swa_kv_pool` (the sliding ones, token slots of their own). Each is the sidecar's group of
that kind (`token_groups`), and both are shared under one memfd (`share_pools`, `reback_pools`)
and registered as one `SharedPools` of two groups (`shared_pools_of`).

Lifecycle (the linker, once, at construction):
    pool_view = KvTensors.of(kv_pool)                        # checked against the geometry
    shared = share_kv(pool_view, kv_pool)                    # in place, else reback
    pools = pool_view.shared_pools(shared, geometries)       # -> client.register_pools
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hicache.channel.shm import SharedPools, map_fd, sealed_memfd
from hicache.errors import PoolShapeError
from hicache.integrations.core.shared_memory import (
    Region,
    SharedMemoryError,
    SharedRegions,
    share_in_place,
)
from hicache.memory import DevicePool, GroupGeometry
from hicache.model import CacheKind

log = logging.getLogger("hicache.sglang")


@dataclass(frozen=True)
class KvTensors:
    """One SGLang MHA pool's per-layer K and V tensors, checked to be token-slot rows."""

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    page_size: int

    @classmethod
    def of(cls, kv_pool: Any) -> KvTensors:
        k, v = getattr(kv_pool, "k_buffer", None), getattr(kv_pool, "v_buffer", None)
        kind = type(kv_pool).__name__
        if not isinstance(k, Sequence) or not isinstance(v, Sequence) or not k or len(k) != len(v):
            raise PoolShapeError(
                f"SGLang's KV pool {kind} has no per-layer k_buffer / v_buffer lists of one "
                "length; the linker moves MHA pools (MHATokenToKVPool) only"
            )
        layout = getattr(kv_pool, "kv_cache_layout", "nhd")
        if getattr(kv_pool, "use_hnd", False) or layout not in (None, "nhd"):
            raise PoolShapeError(
                f"SGLang's KV pool {kind} uses the {layout!r} layout (or HND); the linker "
                "moves token-slot rows ('nhd') only"
            )
        page_size = int(kv_pool.page_size)
        for name, tensors in (("k_buffer", k), ("v_buffer", v)):
            for layer, t in enumerate(tensors):
                if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
                    raise PoolShapeError(
                        f"SGLang's {name}[{layer}] has shape {tuple(t.shape)} and strides "
                        f"{t.stride()}; expected [slots, heads, head_dim] rows, dense per slot"
                    )
                if t.stride(0) != t.shape[1] * t.shape[2] or t.shape[0] % page_size:
                    raise PoolShapeError(
                        f"SGLang's {name}[{layer}]: {t.shape[0]} slots of stride {t.stride(0)}; "
                        f"expected packed slots, a whole number of {page_size}-slot pages"
                    )
        return cls(tuple(k), tuple(v), page_size)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_pages(self) -> int:
        return min(t.shape[0] for t in self.k + self.v) // self.page_size

    def check(self, geometry: GroupGeometry) -> None:
        """The sidecar's geometry of the group must be these tensors' page by page."""
        names = [name for name, _ in geometry.tensors]
        if names != ["k", "v"]:
            raise PoolShapeError(
                f"group {geometry.group.name!r} keeps tensors {names}; SGLang's MHA pool "
                "holds k and v"
            )
        if geometry.page_size_tokens != self.page_size:
            raise PoolShapeError(
                f"page size: SGLang {self.page_size} tokens, the sidecar's deployment "
                f"{geometry.page_size_tokens} (model.page_size_tokens must be SGLang's "
                "--page-size)"
            )
        if geometry.num_layers != self.num_layers:
            raise PoolShapeError(
                f"layers: SGLang's pool {self.num_layers}, the sidecar's group "
                f"{geometry.group.name!r} {geometry.num_layers}"
            )
        for name, tensors in (("k", self.k), ("v", self.v)):
            t = tensors[0]
            page_bytes = self.page_size * t.stride(0) * t.element_size()
            want_dtype = geometry.dtype_of(name)
            if not geometry.accepts_dtype(name, t.dtype) or page_bytes != geometry.row_bytes(name):
                raise PoolShapeError(
                    f"tensor {name!r}: SGLang keeps {self.page_size} slots of "
                    f"{tuple(t.shape[1:])} {t.dtype} ({page_bytes} bytes a page); the sidecar's "
                    f"page is {geometry.row_bytes(name)} bytes of {want_dtype} (check "
                    "model.dtype and the model's heads: SGLang's tensor-parallel share?)"
                )

    def storages(self) -> list[torch.UntypedStorage]:
        return [t.untyped_storage() for t in self.k + self.v]

    def all_tensors(self) -> list[torch.Tensor]:
        return list(self.k + self.v)

    def rebind(self, kv_pool: Any, moved: list[torch.Tensor]) -> None:
        """The pool's `k_buffer` / `v_buffer` replaced by `moved` (`all_tensors`' order)."""
        kv_pool.k_buffer = moved[: len(self.k)]
        kv_pool.v_buffer = moved[len(self.k) :]
        refresh(kv_pool)

    def shared_pools(self, memory: SharedRegions, geometry: GroupGeometry) -> SharedPools:
        """The pool as a `SharedPools` over `memory` (`shared_pools_of`, this pool alone)."""
        return shared_pools_of(memory, [(self, geometry)])

    def rows(self, memory: SharedRegions) -> tuple[list[list[int]], list[list[int]]]:
        """Per layer, K's and V's memfd offsets and page strides: page p of the group is
        SGLang's page p (slots p * page_size ...)."""
        offsets, strides = [], []
        for k, v in zip(self.k, self.v, strict=True):
            offsets.append([memory.offset_of(k.data_ptr()), memory.offset_of(v.data_ptr())])
            strides.append([self.page_size * t.stride(0) * t.element_size() for t in (k, v)])
        return offsets, strides

    def device_pools(self, geometry: GroupGeometry) -> dict[str, DevicePool]:
        """CUDA: the tensors as hicache pools, for `register_cuda_pools` (IPC handles)."""
        pages = self.num_pages * self.page_size
        layers = [{"k": k[:pages], "v": v[:pages]} for k, v in zip(self.k, self.v, strict=True)]
        return {geometry.group.name: DevicePool(geometry, layers)}


class PoolTensors(Protocol):
    """What `share_pools` / `reback_pools` need of a pool's view: its tensors, and how to
    put new ones in the SGLang pool (`KvTensors`; the linker's Mamba state view too)."""

    @property
    def num_pages(self) -> int: ...

    def all_tensors(self) -> list[torch.Tensor]: ...

    def rebind(self, sglang_pool: Any, moved: list[torch.Tensor]) -> None: ...

    def rows(self, memory: SharedRegions) -> tuple[list[list[int]], list[list[int]]]: ...

    def device_pools(self, geometry: GroupGeometry) -> dict[str, DevicePool]: ...


def shared_pools_of(
    memory: SharedRegions, parts: Sequence[tuple[PoolTensors, GroupGeometry]]
) -> SharedPools:
    """SGLang's pools over one memfd as one `SharedPools`, a group per pool (the full pool's
    and, for an SWA model, the SWA pool's). It holds a dup of the memfd (a client closes its
    pool)."""
    geometries, pages, offsets, strides = {}, {}, {}, {}
    for tensors, geometry in parts:
        name = geometry.group.name
        geometries[name] = geometry
        pages[name] = tensors.num_pages
        offsets[name], strides[name] = tensors.rows(memory)
    buffer = torch.empty(0, dtype=torch.uint8)  # the engine computes on SGLang's tensors
    return SharedPools(
        os.dup(memory.fd), memory.nbytes, geometries, pages, offsets, buffer, strides
    )


def share_kv(tensors: KvTensors, kv_pool: Any) -> tuple[SharedRegions, str]:
    """Shared backing for one pool's tensors (`share_pools`)."""
    return share_pools([(tensors, kv_pool)])


def share_pools(pools: Sequence[tuple[PoolTensors, Any]]) -> tuple[SharedRegions, str]:
    """Shared backing for the pools' tensors, one memfd under all: in place, else rebacked
    (`reback_pools`); and which."""
    storages = [t.untyped_storage() for tensors, _ in pools for t in tensors.all_tensors()]
    try:
        return share_in_place(storages, "SGLang's KV pool", "hicache-sglang-kv"), "in place"
    except SharedMemoryError as exc:
        log.info("hicache: SGLang's KV memory not shareable in place (%s); rebacking it", exc)
    return reback_pools(pools), "rebacked"


def reback(tensors: KvTensors, kv_pool: Any) -> SharedRegions:
    """`reback_pools` of one pool."""
    return reback_pools([(tensors, kv_pool)])


def reback_pools(pools: Sequence[tuple[PoolTensors, Any]]) -> SharedRegions:
    """Give the pools' tensors new backing in one sealed memfd: every allocation's bytes copied
    to its place there, and each pool's `k_buffer` / `v_buffer` replaced by tensors of the same
    shapes, strides and offsets over it. Only before the engine computes: anything holding the
    old tensors keeps the old memory (SGLang's pointer tables are rebuilt here)."""
    storages: dict[int, torch.UntypedStorage] = {}
    for tensors, _ in pools:
        for t in tensors.all_tensors():
            storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
    regions, offset = [], 0
    page = mmap.PAGESIZE
    for ptr, storage in storages.items():
        nbytes = -(-storage.nbytes() // page) * page
        regions.append((ptr, offset, storage))
        offset += nbytes
    fd = sealed_memfd("hicache-sglang-kv", offset)
    try:
        whole = map_fd(fd, offset)
    except BaseException:
        os.close(fd)
        raise
    placed: dict[int, Region] = {}
    bases: dict[int, torch.Tensor] = {}
    for ptr, at, storage in regions:
        view = whole[at : at + storage.nbytes()]
        view.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        bases[ptr] = view
        placed[ptr] = Region(view.data_ptr(), at, -(-storage.nbytes() // page) * page)

    def moved(t: torch.Tensor) -> torch.Tensor:
        base = bases[t.untyped_storage().data_ptr()].view(t.dtype)
        # as_strided's offset counts from the mapping's start, not the view's
        return base.as_strided(t.shape, t.stride(), base.storage_offset() + t.storage_offset())

    for tensors, sglang_pool in pools:
        tensors.rebind(sglang_pool, [moved(t) for t in tensors.all_tensors()])
    memory = SharedRegions(fd, offset, tuple(placed.values()))
    memory.keep = whole  # type: ignore[attr-defined]  # the mapping lives while the pool does
    return memory


def refresh(kv_pool: Any) -> None:
    """SGLang's tables of the pool's buffer pointers, rebuilt after `reback`."""
    build = getattr(kv_pool, "_build_kv_buffer_descs", None)
    if build is not None:
        kv_pool._kv_buffer_descs = build()
    init = getattr(kv_pool, "_init_data_ptrs_and_strides", None)
    if init is not None:
        init()


def page_ids(device_indices: Sequence[int] | torch.Tensor, page_size: int) -> list[int] | None:
    """SGLang's token slots of whole pages as page ids; None unless every page's slots are
    `p * page_size + 0 .. page_size - 1` in order (what SGLang's paged allocator hands out)."""
    slots = torch.as_tensor(device_indices, dtype=torch.int64).reshape(-1)
    if slots.numel() % page_size:
        return None
    rows = slots.reshape(-1, page_size)
    first = rows[:, 0]
    if bool((first % page_size).any()):
        return None
    if not torch.equal(rows, first[:, None] + torch.arange(page_size)):
        return None
    return (first // page_size).tolist()


def token_groups(
    geometries: Mapping[str, GroupGeometry],
) -> tuple[GroupGeometry, GroupGeometry | None, GroupGeometry | None]:
    """The deployment's full-attention group (the linker's FULL component), its sliding-window
    group (SWA) and its state group (MAMBA: linear attention, Mamba, short conv), each but
    the first optional; any other group (chunked, sparse) or a second of a kind is refused by
    name."""
    by_kind: dict[str, list[GroupGeometry]] = {"full": [], "sliding": [], "state": []}
    others = []
    for name, geometry in geometries.items():
        kind = geometry.group.kind
        if kind == CacheKind.FULL:
            by_kind["full"].append(geometry)
        elif kind == CacheKind.SLIDING:
            by_kind["sliding"].append(geometry)
        elif not kind.is_token_cache:
            by_kind["state"].append(geometry)
        else:
            others.append(f"{name} ({kind.value})")
    if len(by_kind["full"]) != 1 or max(len(g) for g in by_kind.values()) > 1 or others:
        unmoved = f"; not moved: {', '.join(sorted(others))}" if others else ""
        raise PoolShapeError(
            f"the sidecar's model has cache groups {sorted(geometries)}; the SGLang linker "
            "moves one full-attention group, at most one sliding-window group and one state "
            f"group (FULL, SWA, MAMBA){unmoved}"
        )
    sliding, state = by_kind["sliding"], by_kind["state"]
    return by_kind["full"][0], sliding[0] if sliding else None, state[0] if state else None
