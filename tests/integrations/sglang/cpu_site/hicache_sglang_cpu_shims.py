"""What SGLang 0.5.23's HiCache host pools lack on a CPU, for the tests only.

1. The `direct` kvcacheio copies (`transfer_kv_direct`, `transfer_kv_per_layer_direct_pf_lf`,
   `transfer_kv_all_layer_direct_lf_pf`): `pool_host/mha.py` (and `mla.py`, `mamba.py`,
   `dsa.py`) binds them from the CUDA build of sgl-kernel only, so on a CPU the first transfer
   is a NameError. sgl-kernel's own versions are host code issuing `Tensor.copy_` per
   contiguous run; these do the same with torch.
2. `pool_host.common._cuda_host_register` (cudaHostRegister of the host pool) becomes a no-op.
3. `HostKVCache.pin_memory` reads False (pinned scratch pages need an accelerator).

`install()` applies them to the modules already importable and returns what it patched.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from typing import Any


def _same_length(src_indices: Any, dst_indices: Any, page_size: int) -> None:
    if src_indices.numel() != dst_indices.numel():
        raise RuntimeError(
            f"kvcacheio shim: {src_indices.numel()} source and {dst_indices.numel()} "
            "destination indices; they must match"
        )
    if page_size <= 0 or src_indices.numel() % page_size:
        raise RuntimeError(
            f"kvcacheio shim: {src_indices.numel()} indices are not whole pages of {page_size}"
        )


def _runs(src: Sequence[int], dst: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both advance by one."""
    start = 0
    for i in range(len(src)):
        last = i == len(src) - 1
        if not last and src[i + 1] == src[i] + 1 and dst[i + 1] == dst[i] + 1:
            continue
        yield src[start], dst[start], i + 1 - start
        start = i + 1


def transfer_kv_direct(
    src_layers: Sequence[Any],
    dst_layers: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    page_size: int,
) -> None:
    if len(src_layers) != len(dst_layers):
        raise RuntimeError(
            f"kvcacheio shim: {len(src_layers)} source and {len(dst_layers)} destination layers"
        )
    _same_length(src_indices, dst_indices, page_size)
    for s0, d0, n in _runs(src_indices.tolist(), dst_indices.tolist()):
        for src, dst in zip(src_layers, dst_layers, strict=True):
            dst[d0 : d0 + n].copy_(src[s0 : s0 + n])


def _page_first(
    src: Sequence[Any],
    dst: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    first_layer: int,
    page_size: int,
    to_host: bool,
) -> None:
    """Layer-first device buffers (one per layer, K then V) <-> page-first host buffers
    ([K, V] each [page, layer, page_size, ...]; MLA: one buffer)."""
    _same_length(src_indices, dst_indices, page_size)
    pairs = zip(src_indices[::page_size].tolist(), dst_indices[::page_size].tolist(), strict=True)
    host, device = (dst, src) if to_host else (src, dst)
    mla = len(host) == 1
    layers = len(device) if mla else len(device) // 2
    for s, d in pairs:
        slot, page = (s, d // page_size) if to_host else (d, s // page_size)
        for j in range(layers):
            for part in range(1 if mla else 2):
                rows = device[j + part * layers][slot : slot + page_size]
                cell = host[part][page, first_layer + j]
                (cell if to_host else rows).copy_(rows if to_host else cell)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[Any],
    dst_ptrs: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    layer_id: int,
    page_size: int,
) -> None:
    _page_first(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size, False)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[Any],
    dst_ptrs: Sequence[Any],
    src_indices: Any,
    dst_indices: Any,
    page_size: int,
) -> None:
    _page_first(src_ptrs, dst_ptrs, src_indices, dst_indices, 0, page_size, True)


OPS = {
    "transfer_kv_direct": transfer_kv_direct,
    "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
    "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
}
# the Mamba host pool copies a state slot as MLA's one-buffer page of page size 1
# (`_page_first`), and the DSA indexer pool each page's keys and scales the same way
HOST_POOL_MODULES = (
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.mamba",
    "sglang.srt.mem_cache.pool_host.dsa",
)


def install() -> list[str]:
    import torch

    done = []
    for name in HOST_POOL_MODULES:
        module = importlib.import_module(name)
        for op, fn in OPS.items():
            setattr(module, op, fn)
        done.append(name)
    if not torch.cuda.is_available():
        from sglang.srt.mem_cache.pool_host import common
        from sglang.srt.mem_cache.pool_host.base import HostKVCache

        common._cuda_host_register = lambda *args, **kwargs: None
        HostKVCache.pin_memory = property(lambda self: False, lambda self, value: None)
        done += ["pool_host.common._cuda_host_register", "HostKVCache.pin_memory"]
    return done
