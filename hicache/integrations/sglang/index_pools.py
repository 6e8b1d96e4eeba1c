"""SGLang's DSA indexer host pool (a v2 side pool, `PoolName.INDEXER`) as the index rows of the
sidecar's sparse group, page for page.

DeepSeek-V3.2 and GLM-5 keep, per token and layer, the MLA latent (SGLang's KV host pool,
`host_pools`) and an indexer key: float8_e4m3fn keys with one float32 scale per 128 dims,
132 bytes a token, each page holding its P tokens' keys and then their scales. SGLang's
`DSAIndexerPoolHost` keeps them in a buffer of its own, indexed by the KV pool's host pages
(its `indices_from_pool` is KV: host page p of the latents is host page p of the keys):

    layer_first                     [L, pages, P*132]     page p of layer l at (l*pages + p)*S
    page_first / page_first_direct  [pages, L, 1, P*132]  page p of layer l at (p*L + l)*S

(S = P*132 bytes, `indexer_page_stride_size`.) hicache's sparse group under
`model.index_format: fp8_scaled` has exactly those rows beside the latent: `index_k`
(P x 128 bytes) and `index_k_scale` (P x 4 bytes), the scales starting P*128 bytes into the
page. So the index rows join the group's latent rows in one manifest (`host_pool_manifest`'s
`more_rows`), and a page the sidecar stores or loads moves the latent and its keys together:
one page never holds the latent of one prompt and the keys of another. SGLang moves them as
two pools (the keys by `batch_*_v2` right beside the KV's `batch_*_v1`, same keys, same host
pages): `storage_v2` answers the second from what the first moved.

Refused, each by name (`IndexPoolError`): another pool class, a layout other than the KV
pool's, MTP draft layers or shared-top-k layers (no host rows for some layers), keys SGLang
pre-shuffles (ROCm's aiter layout: other bytes), and a sidecar group whose index is not
fp8_scaled (the message says to set it).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hicache.errors import HicacheError
from hicache.integrations.core.shared_memory import SharedRegions
from hicache.integrations.sglang.host_pools import HostKv
from hicache.memory import GroupGeometry
from hicache.model.specs import INDEX_SCALE

INDEX_KEYS = "index_k"
LAYOUTS = ("layer_first", "page_first", "page_first_direct")  # DSAIndexerPoolHost's


class IndexPoolError(HicacheError):
    """SGLang's indexer pool does not fit the sidecar's group (the message names each
    mismatch)."""


@dataclass(frozen=True, slots=True)
class HostIndex:
    """What SGLang's DSA indexer host pool says about itself."""

    layout: str
    layers: int
    page_size: int
    pages: int  # pages of its buffer (a page or two more than the KV pool's)
    page_bytes: int  # one layer's page: the keys, then the scales
    buffer: Any

    @classmethod
    def of(cls, host_pool: Any, kv: HostKv) -> HostIndex:
        """The pool beside SGLang's KV host pool `kv`; its variants refused by name."""
        kind = type(host_pool).__name__
        if kind != "DSAIndexerPoolHost":
            raise IndexPoolError(
                f"SGLang's indexer side pool is a {kind}; hicache maps DSAIndexerPoolHost"
            )
        layout = str(host_pool.layout)
        if layout != kv.layout:
            raise IndexPoolError(
                f"SGLang's indexer host pool is {layout}, its KV host pool {kv.layout}"
            )
        layers, target = int(host_pool.layer_num), int(host_pool.target_layer_num)
        live = list(getattr(host_pool, "_live_target_layers", range(target)))
        unmapped = []
        if layers != target:
            unmapped.append(f"{layers - target} MTP draft layers")
        if target != kv.layers or live != list(range(kv.layers)):
            unmapped.append(
                f"keys for layers {live} of the KV pool's {kv.layers} (shared-top-k layers "
                "keep none)"
            )
        if _preshuffled():
            unmapped.append("keys pre-shuffled for ROCm's aiter kernels")
        buffer = getattr(host_pool, "index_k_with_scale_buffer", None)
        if buffer is None:
            unmapped.append("no host buffer (allocator-only)")
        if unmapped:
            raise IndexPoolError(
                f"SGLang's DSA indexer host pool holds {', '.join(unmapped)}; hicache maps one "
                "row of keys and scales per layer of the target model"
            )
        assert buffer is not None
        if layout not in LAYOUTS:
            raise IndexPoolError(
                f"--hicache-mem-layout {layout} with a DSA model: hicache maps "
                + ", ".join(LAYOUTS)
            )
        pages = int(buffer.shape[1] if layout == "layer_first" else buffer.shape[0])
        return cls(
            layout=layout,
            layers=layers,
            page_size=int(host_pool.page_size),
            pages=pages,
            page_bytes=int(host_pool.indexer_page_stride_size) * int(buffer.element_size()),
            buffer=buffer,
        )

    def reach(self, kv_pages: int) -> tuple[int, int]:
        """The addresses its rows of the KV pool's `kv_pages` pages use: the buffer's pages
        past them (it keeps a page or two more) are left out of the memory shared with the
        sidecar, which maps exactly what its rows reach (no slack)."""
        lo = int(self.buffer.data_ptr())
        if self.layout == "layer_first":
            return lo, lo + ((self.layers - 1) * self.pages + kv_pages) * self.page_bytes
        return lo, lo + kv_pages * self.layers * self.page_bytes


def _preshuffled() -> bool:
    """Whether SGLang keeps index keys in ROCm's pre-shuffled tiles (other bytes in a page)."""
    try:
        from sglang.srt.mem_cache import index_key_cache
    except ImportError:  # an SGLang without the module: keys as DSA lays them out
        return False
    return bool(getattr(index_key_cache, "_use_aiter_preshuffle", False))


def index_tensors(geometry: GroupGeometry) -> list[str]:
    """The group's index tensors (after the latent), as its geometry orders them."""
    return [name for name, _ in geometry.tensors if name.startswith("index_")]


def check_index(index: HostIndex, group: str, geometry: GroupGeometry) -> None:
    """Every difference between SGLang's indexer pool and the sidecar's group, named."""
    names = index_tensors(geometry)
    if names != [INDEX_KEYS, INDEX_SCALE]:
        raise IndexPoolError(
            f"the sidecar's group {group!r} keeps index tensors {names}; SGLang keeps DSA "
            "index keys as fp8 with a float32 scale per 128 dims (132 bytes a token): set "
            "model.index_format: fp8_scaled in the deployment"
        )
    wrong = []
    if geometry.num_layers != index.layers:
        wrong.append(f"layers: SGLang {index.layers}, sidecar {geometry.num_layers}")
    keys, scales = geometry.row_bytes(INDEX_KEYS), geometry.row_bytes(INDEX_SCALE)
    if keys + scales != index.page_bytes:
        wrong.append(
            f"a layer's page: SGLang {index.page_bytes} bytes of keys and scales, sidecar "
            f"{keys} + {scales} bytes"
        )
    if wrong:
        raise IndexPoolError(
            f"SGLang's DSA indexer host pool does not match the sidecar's group {group!r}: "
            + "; ".join(wrong)
        )


def index_rows(
    region: SharedRegions, index: HostIndex, geometry: GroupGeometry
) -> tuple[list[list[int]], list[list[int]]]:
    """Per layer the `index_k` and `index_k_scale` row offsets and page strides over `region`
    (shared in place with the pool's buffer), in the module doc's layouts."""
    base = region.offset_of(index.buffer.data_ptr())
    scale_at = geometry.row_bytes(INDEX_KEYS)  # a page's keys come first
    offsets, strides = [], []
    for layer in range(index.layers):
        if index.layout == "layer_first":
            row, stride = base + layer * index.pages * index.page_bytes, index.page_bytes
        else:
            row, stride = base + layer * index.page_bytes, index.layers * index.page_bytes
        offsets.append([row, row + scale_at])
        strides.append([stride, stride])
    return offsets, strides


def needs_index(geometries: Mapping[str, GroupGeometry], group: str) -> bool:
    """Whether the KV pool's group keeps index rows no KV pool holds (a DSA model's)."""
    return bool(index_tensors(geometries[group]))


class LastKvLoads:
    """Per controller thread, its last KV load (`batch_get_v1`): keys, host pages and the
    leading pages it moved. SGLang asks for a DSA model's indexer keys right after, on the same
    thread, for the same keys and pages; that load already wrote their rows, so its answer is
    the indexer's (`storage_v2._beside_kv`). Per thread: none -> recorded (each KV load
    replaces it) -> taken once by the next indexer call, which gets the count only when its
    keys and pages are the recorded ones (any other call must load for itself)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def record(self, keys: Sequence[str], pages: Sequence[int], loaded: int) -> None:
        self._local.last = (tuple(keys), tuple(pages), loaded)

    def take(self, keys: Sequence[str], pages: Sequence[int] | None) -> int | None:
        """The pages this thread's last KV load moved for exactly these keys and pages, or
        None (nothing recorded, or another batch); the record is gone either way."""
        last, self._local.last = getattr(self._local, "last", None), None
        if last is None or pages is None or last[:2] != (tuple(keys), tuple(pages)):
            return None
        return int(last[2])
