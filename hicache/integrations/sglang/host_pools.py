"""SGLang's HiCache host KV pool as the pool the sidecar copies into, page for page.

SGLang's `MHATokenToKVPoolHost` keeps K and V of every layer for `size` token slots in one
buffer, `kv_buffer[2, ...]` (K half, then V half), in one of four layouts. A host page p
(slots p*P .. p*P+P-1) of layer l holds P x heads x head_dim elements per tensor — exactly one
row of hicache's page geometry for a full-attention group (`row_bytes`: P*H*D*itemsize) — at:

    layer_first        [2, L, size, H, D]       K row at  l*size*H*D*isz + p*R   (stride R)
    page_first_direct  [2, pages, L, P, H, D]   K row at  (p*L + l)*R            (stride L*R)
    page_first         [2, size, L, H, D]       the page's L*R bytes at p*L*R, token-major
    page_head          [2, pages, H, P, L, D]   the page's L*R bytes at p*L*R, head-major

(R = P*H*D*itemsize; V at the same offsets in the second half.) SGLang's
`MLATokenToKVPoolHost` (DeepSeek-V2/V3, Kimi K2, ...: one latent of kv_lora_rank + rope dims
per token and layer, no V) keeps `kv_buffer` as one such half with H = 1 and D the latent's
width, in layer_first, page_first and page_first_direct, and maps to the group's one `kv`
tensor (an MLA group of hicache's layout). The latent is the same on every TP rank: the
sidecar keys an MLA group as rank 0 on every rank (`cache.keyers`), so one page serves every
rank, as SGLang's own backends share MLA pages across ranks. layer_first and
page_first_direct hold the same bytes in each row, so engines of either layout share pages;
page_first and page_head are registered as L rows of R bytes cut from the page's K (V) region:
byte-exact for engines of the same layout, other bytes for another, so each of those layouts
gets a tenant of its own (`tenant_of`) and never shares with the rest.

`host_pool_manifest` describes the buffer, shared in place (`core.shared_memory`), as a
`SharedPools` with per-layer offsets and page strides (`hicache.channel.shm`): the sidecar maps
SGLang's host pages as its device pages, and page p for the sidecar is SGLang's host page p.
A hybrid model's other groups go in the same manifest, over the same memfd: its state group
(SGLang's Mamba side pool, `side_pools`) and its sliding-window group (SGLang's SWA side pool:
another host KV pool of the sliding layers, mapped as the KV pool is, `kv_rows`). Not mapped
(refused with the reason): MLA pools SGLang splits natively (NPU's DSA / NSA buffers), packed
FP8 rows, MTP draft layers, page_head / page_unified layouts for MLA, and a layout with no or
several full-attention groups. A DSA model's indexer keys are its own side pool's
(`index_pools`): their rows join the latent's in the same group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicache.channel.shm import SharedPools
from hicache.errors import HicacheError
from hicache.index import GroupRule
from hicache.integrations.core.shared_memory import SharedRegions
from hicache.memory import GroupGeometry

ROW_LAYOUTS = ("layer_first", "page_first_direct")  # each page's per-layer rows are hicache's
CUT_LAYOUTS = ("page_first", "page_head")  # each page's K (V) region cut into L rows
MLA_LAYOUTS = ("layer_first", "page_first_direct", "page_first")  # MLATokenToKVPoolHost's
TENANT = "sglang"


class HostPoolError(HicacheError):
    """SGLang's host pool does not fit the sidecar's layout (the message names each mismatch)."""


@dataclass(frozen=True, slots=True)
class HostKv:
    """What SGLang's KV host pool says about itself."""

    layout: str
    layers: int
    page_size: int
    size: int  # token slots
    heads: int
    head_dim: int
    dtype: str  # torch's name without the prefix, e.g. "bfloat16"
    itemsize: int
    latent: bool = False  # an MLA pool: one tensor (the latent, `heads` 1), no V half

    @property
    def pages(self) -> int:
        return self.size // self.page_size

    @property
    def row_bytes(self) -> int:
        return self.page_size * self.heads * self.head_dim * self.itemsize

    @property
    def tensors(self) -> tuple[str, ...]:
        """hicache's tensors this pool's halves hold, in order."""
        return ("kv",) if self.latent else ("k", "v")

    @classmethod
    def of(cls, host_pool: Any) -> HostKv:
        kind = type(host_pool).__name__
        if kind == "MLATokenToKVPoolHost":
            return cls.of_latent(host_pool)
        if kind != "MHATokenToKVPoolHost":
            raise HostPoolError(
                f"SGLang's host KV pool is a {kind}; hicache maps MHATokenToKVPoolHost (MHA/GQA "
                "models) and MLATokenToKVPoolHost (MLA models)"
            )
        layout = str(host_pool.layout)
        if layout not in ROW_LAYOUTS + CUT_LAYOUTS:
            raise HostPoolError(
                f"--hicache-mem-layout {layout}: hicache maps "
                + ", ".join(ROW_LAYOUTS + CUT_LAYOUTS)
            )
        dtype = host_pool.dtype
        return cls(
            layout=layout,
            layers=int(host_pool.layer_num),
            page_size=int(host_pool.page_size),
            size=int(host_pool.size),
            heads=int(host_pool.head_num),
            head_dim=int(host_pool.head_dim),
            dtype=str(dtype).removeprefix("torch."),
            itemsize=int(dtype.itemsize),
        )

    @classmethod
    def of_latent(cls, host_pool: Any) -> HostKv:
        """An `MLATokenToKVPoolHost` of one latent buffer; its variants refused by name."""
        layout = str(host_pool.layout)
        if layout not in MLA_LAYOUTS:
            raise HostPoolError(
                f"--hicache-mem-layout {layout} with an MLA model: hicache maps "
                + ", ".join(MLA_LAYOUTS)
            )
        target, layers = int(host_pool.target_layer_num), int(host_pool.layer_num)
        unmapped = []
        if getattr(host_pool, "_native_buffers", None) is not None:
            unmapped.append("its MLA buffers split natively (NPU's DSA / NSA)")
        if getattr(host_pool, "dsa_kv_cache_store_fp8", False):
            unmapped.append("packed FP8 rows")
        if layers != target:
            unmapped.append(f"{layers - target} MTP draft layers")
        if getattr(host_pool, "kv_buffer", None) is None:
            unmapped.append("no host buffer (allocator-only)")
        if unmapped:
            raise HostPoolError(
                f"SGLang's MLA host pool holds {', '.join(unmapped)}; hicache maps one latent "
                "buffer of the target model's layers"
            )
        dtype = host_pool.dtype
        return cls(
            layout=layout,
            layers=layers,
            page_size=int(host_pool.page_size),
            size=int(host_pool.size),
            heads=1,
            head_dim=int(host_pool.kv_cache_dim),
            dtype=str(dtype).removeprefix("torch."),
            itemsize=int(dtype.itemsize),
            latent=True,
        )


def tenant_of(layout: str) -> str:
    """The tenant SGLang's pages go under: one per byte layout of a page (see the module doc)."""
    return TENANT if layout in ROW_LAYOUTS else f"{TENANT}-{layout.replace('_', '-')}"


def kv_group(host: HostKv, geometries: Mapping[str, GroupGeometry], page_size_tokens: int) -> str:
    """The one whole-prefix (full-attention) token group SGLang's KV host pool maps to
    (sliding-window and state groups are side pools'); every mismatch named."""
    whole = sorted(g for g, geo in geometries.items() if GroupRule.of(geo.group).needs_whole_prefix)
    if len(whole) != 1:
        raise HostPoolError(
            f"the sidecar's layout caches full-attention groups {whole}; SGLang's KV host pool "
            "maps to a layout of exactly one, beside its sliding-window and state groups"
        )
    check_kv(host, whole[0], geometries[whole[0]], page_size_tokens)
    return whole[0]


def check_kv(host: HostKv, name: str, geometry: GroupGeometry, page_size_tokens: int) -> None:
    """Every difference between an SGLang KV host pool and the sidecar's group, named."""
    wrong = []
    if page_size_tokens != host.page_size:
        wrong.append(f"page size: SGLang {host.page_size}, sidecar {page_size_tokens}")
    if geometry.num_layers != host.layers:
        wrong.append(f"layers: SGLang {host.layers}, sidecar {geometry.num_layers}")
    # a sparse group's index rows are SGLang's indexer pool's (`index_pools`), not the KV's
    names = [tensor for tensor, _ in geometry.tensors if not tensor.startswith("index_")]
    if names != list(host.tensors):
        what = "the MLA latent ('kv')" if host.latent else "K and V"
        wrong.append(f"tensors: SGLang {what}, sidecar {names}")
    else:
        shapes = dict(geometry.tensors)
        given = getattr(torch, host.dtype, None)
        for tensor in names:
            # bytes alone would let bfloat16 pass for float16, or 4 heads of 64 for 2 of 128
            shape = tuple(shapes[tensor])
            want_dtype = str(geometry.dtype_of(tensor)).removeprefix("torch.")
            same_dtype = isinstance(given, torch.dtype) and geometry.accepts_dtype(tensor, given)
            if (
                geometry.row_bytes(tensor) != host.row_bytes
                or shape != (host.heads, host.head_dim)
                or not same_dtype
            ):
                wrong.append(
                    f"{tensor} page row: SGLang {host.page_size} x {host.heads} heads x "
                    f"{host.head_dim} x {host.dtype} ({host.row_bytes} bytes), sidecar "
                    f"{geometry.page_size_tokens} x {shape[0]} heads x {shape[1]} x "
                    f"{want_dtype} ({geometry.row_bytes(tensor)} bytes)"
                )
    if wrong:
        raise HostPoolError(
            f"SGLang's host pool does not match the sidecar's group {name!r}: " + "; ".join(wrong)
        )


def kv_rows(
    region: SharedRegions, kv_buffer: Any, host: HostKv
) -> tuple[list[list[int]], list[list[int]]]:
    """An SGLang KV host buffer's per-layer K and V (an MLA pool's latent) row offsets and
    page strides over `region` (shared in place), in the module doc's layouts."""
    base = region.offset_of(kv_buffer.data_ptr())
    row = host.row_bytes
    half = host.layers * host.size * host.heads * host.head_dim * host.itemsize
    offsets, strides = [], []
    for layer in range(host.layers):
        if host.layout == "layer_first":
            k, stride = base + layer * (half // host.layers), row
        else:  # one page's L rows (or its L*R region) after another
            k, stride = base + layer * row, host.layers * row
        offsets.append([k] if host.latent else [k, k + half])
        strides.append([stride] * len(host.tensors))
    return offsets, strides


def host_pool_manifest(
    region: SharedRegions,
    kv_buffer: Any,
    host: HostKv,
    group: str,
    geometry: GroupGeometry,
    side: Mapping[str, SideRows] | None = None,
    more_rows: tuple[list[list[int]], list[list[int]]] | None = None,
) -> SharedPools:
    """SGLang's host KV buffer (shared in place as `region`) as a `SharedPools` of the group's
    page rows (with `more_rows`, per layer, after the KV's: a DSA model's index rows,
    `index_pools`), and each side pool's group (`side`: its geometry, slots, per-layer offsets
    and strides over the same region); it holds a dup of the region's descriptor (the client
    closes it with itself)."""
    offsets, strides = kv_rows(region, kv_buffer, host)
    if more_rows is not None:
        offsets = [row + more for row, more in zip(offsets, more_rows[0], strict=True)]
        strides = [row + more for row, more in zip(strides, more_rows[1], strict=True)]
    geometries, pages = {group: geometry}, {group: host.pages}
    all_offsets, all_strides = {group: offsets}, {group: strides}
    for name, rows in (side or {}).items():
        geometries[name], pages[name] = rows.geometry, rows.pages
        all_offsets[name], all_strides[name] = rows.offsets, rows.strides
    # one region's memory is one buffer; several regions' (side pools' buffers beside the KV
    # buffer) are registered by offsets alone: the sidecar maps the memfd, not this view
    buffer = region.buffer() if len(region.regions) == 1 else torch.empty(0, dtype=torch.uint8)
    return SharedPools(
        os.dup(region.fd), region.nbytes, geometries, pages, all_offsets, buffer, all_strides
    )


@dataclass(frozen=True, slots=True)
class SideRows:
    """A side pool's group in a manifest: its geometry, slots and rows (`side_pools`)."""

    geometry: GroupGeometry
    pages: int
    offsets: list[list[int]]
    strides: list[list[int]]


def host_pages(host_indices: Any, page_size: int, count: int) -> list[int] | None:
    """The host pages of `count` pages given as token slots (SGLang's `host_indices`, page i
    from slot i*page_size); None when they are not whole pages of `count`."""
    if int(host_indices.numel()) != count * page_size:
        return None
    firsts: Sequence[int] = host_indices[::page_size].tolist()
    if any(slot % page_size for slot in firsts):
        return None
    return [slot // page_size for slot in firsts]
