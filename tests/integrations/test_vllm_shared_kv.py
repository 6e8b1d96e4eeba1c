"""vLLM's KV memory shared in place (`vllm/shared_kv.py`), without vLLM: an allocation made
as vLLM makes it (one `torch.zeros`, per-layer `[blocks, heads, block, 2 * head]` views) gets
memfd backing under the same addresses, its bytes kept; the sidecar's side maps it from the
manifest as page rows at the block stride, and what either side writes the other reads, in
exactly the block and byte range named."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hicache.channel.shm import map_pools
from hicache.integrations.core.shared_memory import SharedMemoryError
from hicache.integrations.vllm.binding import bind_layers
from hicache.integrations.vllm.shared_kv import blocks_pools, data_plane, share_blocks
from hicache.memory import CacheDtypes, GroupGeometry
from hicache.model import LayerMap, load_layout
from tests.conftest import shared_model

BLOCK = 16


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_free_bytes() -> int:
    """Bytes free in glibc's main heap (`mallinfo2().fordblks`): a request larger than that
    cannot be served from the heap, so glibc mmaps it (over its 32 MiB threshold at most)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    return int(libc.mallinfo2().fordblks)


def _vllm_like(
    blocks: int, make: Callable[[int], torch.Tensor] | None = None
) -> tuple[LayerMap, dict[str, GroupGeometry], torch.Tensor, dict]:
    """Llama-3.1-8B's layout at 16-token blocks: one int8 allocation that glibc mmaps, as it
    does vLLM's GiBs (over 32 MiB, and larger than what the heap has free: earlier tests in
    this process may have left a free heap chunk big enough, which malloc would use first),
    each layer a view `[blocks, 8, 16, 256]` bf16 at its layer offset. `make(nbytes)`: the
    allocation made otherwise (an int8 tensor of at least `nbytes`)."""
    layer_map = LayerMap(load_layout(shared_model("llama-3.1-8b.json")))
    dtypes = CacheDtypes.from_names("bfloat16", None, None)
    geometries = {g.name: GroupGeometry.of(g, dtypes, BLOCK) for g in layer_map.groups}
    spec = layer_map.groups[0].spec
    per_block = spec.num_kv_heads * BLOCK * 2 * spec.head_dim
    layers = len(layer_map.stage_layer_ids)
    size = layers * blocks * per_block * 2
    if make is None:
        buf = torch.zeros(max(size, _heap_free_bytes() + (1 << 20)), dtype=torch.int8)
    else:
        buf = make(size)
    caches = {
        f"model.layers.{i}.self_attn.attn": buf[
            i * blocks * per_block * 2 : (i + 1) * blocks * per_block * 2
        ]
        .view(torch.bfloat16)
        .view(blocks, spec.num_kv_heads, BLOCK, 2 * spec.head_dim)
        for i in layer_map.stage_layer_ids
    }
    return layer_map, geometries, buf, caches


def _bind(layer_map: LayerMap, geometries: dict, caches: dict) -> dict:
    index = {name: int(name.split(".")[2]) for name in caches}
    return bind_layers(layer_map, geometries, caches, index, dict.fromkeys(caches, 0), {})


def test_the_allocation_keeps_its_address_and_bytes_and_the_sidecar_sees_vllms_blocks() -> None:
    layer_map, geometries, buf, caches = _vllm_like(blocks=20)
    generator = torch.Generator().manual_seed(0)
    buf.copy_(torch.randint(-128, 127, buf.shape, generator=generator, dtype=torch.int8))
    before, address = buf.clone(), buf.data_ptr()
    bindings = _bind(layer_map, geometries, caches)
    memory = share_blocks(bindings)
    try:
        assert buf.data_ptr() == address
        assert torch.equal(buf, before)  # every byte kept
        pools = blocks_pools(memory, bindings, geometries)
        # the sidecar's side: the engine's descriptor, checked and mapped from the manifest
        mapped, _ = map_pools(pools.manifest() | {"counters_fd": 0}, geometries, os.getpid())
        full = mapped["full"]
        assert full.num_pages == 20
        layer, local = 5, layer_map.group("full").layer_ids.index(5)
        cache = caches[f"model.layers.{layer}.self_attn.attn"]
        k_rows, v_rows = full.layer_rows(local)
        block = cache.view(cache.shape[0], -1).view(torch.uint8)  # vLLM's blocks as bytes
        k_bytes = k_rows.shape[1]
        assert torch.equal(k_rows[3], block[3, :k_bytes])
        # a load's copy into page 3's V row lands in vLLM's block 3, nowhere else
        others = block.clone()
        v_rows[3].fill_(7)
        assert block[3, k_bytes:].eq(7).all()
        others[3, k_bytes:] = 7
        assert torch.equal(block, others)
        # and what vLLM writes (its forward), the sidecar reads (a store)
        cache[2].fill_(1.5)
        assert torch.equal(k_rows[2], block[2, :k_bytes])
        assert k_rows[2].view(torch.bfloat16).eq(1.5).all()
    finally:
        memory.close()


def test_two_allocations_are_refused_by_name() -> None:
    layer_map, geometries, _, caches = _vllm_like(blocks=20)
    name = "model.layers.3.self_attn.attn"
    caches[name] = caches[name].clone()
    with pytest.raises(SharedMemoryError, match=r"^vLLM's KV tensors live in 2 allocations"):
        share_blocks(_bind(layer_map, geometries, caches))


def test_a_manifest_row_past_the_pool_is_refused() -> None:
    layer_map, geometries, _, caches = _vllm_like(blocks=20)
    bindings = _bind(layer_map, geometries, caches)
    memory = share_blocks(bindings)
    try:
        manifest = blocks_pools(memory, bindings, geometries).manifest()
        manifest["groups"]["full"]["page_strides"][31][1] += 4096
        with pytest.raises(Exception, match=r"run past the pool's"):
            map_pools(manifest | {"counters_fd": 0}, geometries, os.getpid())
        manifest["groups"]["full"]["page_strides"][0][0] = 8
        with pytest.raises(Exception, match=r"page_strides\[0\] \(k\): 8; allowed: a multiple"):
            map_pools(manifest | {"counters_fd": 0}, geometries, os.getpid())
    finally:
        memory.close()


def test_a_client_that_failed_leaves_the_memory_registrable() -> None:
    """A client closes the pools it registered; each registration gets a descriptor of its
    own, so after a failed first try (a timed-out hello) the next client still registers
    vLLM's memory, the same memory (identity) the first one named."""
    layer_map, geometries, _, caches = _vllm_like(blocks=20)
    bindings = _bind(layer_map, geometries, caches)
    memory = share_blocks(bindings)
    try:
        first = blocks_pools(memory, bindings, geometries)
        _, mapped = map_pools(first.manifest() | {"counters_fd": 0}, geometries, os.getpid())
        first.close()  # what the failed client did
        second = blocks_pools(memory, bindings, geometries)
        _, again = map_pools(second.manifest() | {"counters_fd": 0}, geometries, os.getpid())
        second.close()
        assert again.identity == mapped.identity
    finally:
        memory.close()


def test_vllms_memory_is_allocated_and_mapped_once_shared() -> None:
    """vLLM's zeroed cache was resident before it was shared; it stays so: every page of the
    memfd is allocated (zero chunks too) and mapped in vLLM's process, so neither vLLM's
    forward nor the sidecar's first copy into a block faults on it (faults counted by the
    kernel for this thread, on numpy's one-thread fill)."""
    import resource

    from hicache.channel.prefault import allocated_extents

    layer_map, geometries, buf, caches = _vllm_like(blocks=20)
    buf[: buf.numel() // 2].fill_(3)  # half written, half still torch.zeros' zeros
    bindings = _bind(layer_map, geometries, caches)
    memory = share_blocks(bindings)
    try:
        assert allocated_extents(memory.fd, memory.nbytes) == [(0, memory.nbytes)]
        array = buf.numpy()
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        array.fill(5)
        assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before == 0
    finally:
        memory.close()


def test_a_kv_cache_in_shared_anonymous_memory_longer_than_its_rows_is_shared() -> None:
    """The rules are the core's (`core.shared_memory`): vLLM's KV cache in a shared anonymous
    mapping (`/dev/zero`, `rw-s`) of a size that is no page multiple was refused while the
    vLLM path had rules of its own (private anonymous `rw-p` memory only, page-multiple
    sizes); now it is shared, bytes and address kept. Only the pages the rows reach are: the
    memfd ends where they do, as the sidecar requires of a manifest (no slack), though the
    allocation runs on a page and more."""
    held: list[mmap.mmap] = []

    def shared_anonymous(nbytes: int) -> torch.Tensor:
        held.append(mmap.mmap(-1, nbytes + mmap.PAGESIZE + 100))  # MAP_SHARED | MAP_ANONYMOUS
        return torch.frombuffer(held[-1], dtype=torch.int8)

    layer_map, geometries, buf, caches = _vllm_like(blocks=4, make=shared_anonymous)
    rows_bytes = buf.numel() - mmap.PAGESIZE - 100
    assert buf.data_ptr() % mmap.PAGESIZE == 0
    assert buf.numel() % mmap.PAGESIZE != 0
    generator = torch.Generator().manual_seed(1)
    buf.copy_(torch.randint(-128, 127, buf.shape, generator=generator, dtype=torch.int8))
    before, address = buf.clone(), buf.data_ptr()
    bindings = _bind(layer_map, geometries, caches)
    memory = share_blocks(bindings)
    try:
        assert buf.data_ptr() == address
        assert torch.equal(buf, before)
        assert memory.nbytes == rows_bytes  # a page multiple: Llama's blocks are
        mapped, _ = map_pools(
            blocks_pools(memory, bindings, geometries).manifest() | {"counters_fd": 0},
            geometries,
            os.getpid(),
        )
        cache = caches["model.layers.7.self_attn.attn"]
        k_rows, _ = mapped["full"].layer_rows(layer_map.group("full").layer_ids.index(7))
        block = cache.view(cache.shape[0], -1).view(torch.uint8)
        k_rows[1].fill_(9)  # the sidecar's write lands in vLLM's block 1
        assert block[1, : k_rows.shape[1]].eq(9).all()
    finally:
        memory.close()


def test_a_file_mapped_kv_cache_is_refused_by_name_and_the_worker_stages(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file's pages are never replaced (the file would stop seeing vLLM's writes): refused
    naming vLLM's KV cache and the mapping, nothing remapped, and `data_plane` stages
    instead, logging that reason."""
    path = tmp_path / "kv"

    def file_mapped(nbytes: int) -> torch.Tensor:
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.int8)

    layer_map, geometries, buf, caches = _vllm_like(blocks=4, make=file_mapped)
    buf.fill_(3)
    bindings = _bind(layer_map, geometries, caches)
    refusal = (
        r"vLLM's KV cache at 0x[0-9a-f]+\.\.0x[0-9a-f]+ lies in the mapping '.*/kv'; only "
        r"read-write anonymous, /dev/zero or memfd memory is shared in place"
    )
    with pytest.raises(SharedMemoryError, match="^" + refusal + "$"):
        share_blocks(bindings)
    with caplog.at_level(logging.INFO, logger="hicache.vllm"):
        plane = data_plane(layer_map, bindings, geometries, None)
    assert plane.register is None
    assert plane.memory is None
    staged = [r.getMessage() for r in caplog.records if "staging" in r.getMessage()]
    assert len(staged) == 1, staged
    assert re.fullmatch(r"hicache: staging vLLM's blocks \(" + refusal + r"\)", staged[0])
    buf.fill_(4)  # still the file's memory: the file sees vLLM's writes
    assert path.read_bytes()[: buf.numel()] == b"\x04" * buf.numel()
