"""SGLang's own `HybridCacheController` with a DSA model's pools — `DSATokenToKVPool`, its
`MLATokenToKVPoolHost` and its `DSAIndexerPoolHost` side pool (`PoolName.INDEXER`, indices from
the KV pool), built as SGLang's `_DsaStrategy` builds them — without the engine, with hicache's
storage backend, in a process of its own (`dsa_harness.DsaControllers` starts it). What SGLang's
cache does around them (the INDEXER transfer beside every KV transfer,
`UnifiedRadixCache._sidecar_transfers`) is done here step by step.

    python -m tests.integrations.sglang.dsa_driver

Lifecycle and protocol as `controller_driver`'s (it runs on that driver's `Harness`: one JSON
command a line on stdin, one reply a line on stdout). Commands:
    {"op": "start", "name", "layout", "allocator", "extra"}  a controller -> {"attached",
        "refused", "side_pools", "indexer_group"}
    {"op": "fill", "name", "seed", "pages"}  seeded latents and index pages on the device ->
        host (both pools) -> hicache -> {"l1_l2_ok", "backed_up_tokens", "indexer_stored"};
        then host and device cleared
    {"op": "fetch", "name", "seed", "pages"}  hit query, prefetch (KV then INDEXER per batch),
        host -> device of both pools -> {"hit_pages", "fetched_tokens", "indexer_hits",
        "match"}: match is the latents and index pages byte-exact on host and device
    {"op": "stop", "name"}
"""

from __future__ import annotations

import time
from typing import Any

from tests.integrations.sglang import controller_driver

L, P = 2, 64  # layers; DSA's pages are 64 tokens (SGLang asserts it)
RANK, ROPE, INDEX_DIM = 64, 32, 128  # kv_lora_rank, qk_rope_head_dim, index_head_dim
LATENT = RANK + ROPE
INDEX_PAGE = P * (INDEX_DIM + INDEX_DIM // 128 * 4)  # a page's fp8 keys, then fp32 scales
DEVICE_PAGES = 8
HOST_RATIO = 2.0


def tokens_of(seed: int, pages: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 3 for i in range(pages * P)]


class DsaHarness(controller_driver.Harness):
    def start(  # type: ignore[override]
        self, name: str, layout: str, allocator: str, extra: dict[str, Any]
    ) -> dict[str, Any]:
        torch = self.torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
        from sglang.srt.mem_cache.pool_host.dsa import (
            DSAIndexerPoolHost,
            make_dsa_indexer_pool_decl,
        )
        from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        dev = DSATokenToKVPool(
            size=P * DEVICE_PAGES,
            page_size=P,
            kv_lora_rank=RANK,
            dtype=torch.bfloat16,
            qk_rope_head_dim=ROPE,
            layer_num=L,
            device="cpu",
            index_head_dim=INDEX_DIM,
            enable_memory_saver=False,
            kv_cache_dim=LATENT,
            start_layer=0,
            end_layer=L,
        )
        alloc = PagedTokenToKVPoolAllocator(
            P * DEVICE_PAGES, P, torch.bfloat16, "cpu", dev, need_sort=False
        )
        kv_host = MLATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info,
            HOST_RATIO,
            0,
            P,
            layout,
            pin_memory=False,
            device="cpu",
            allocator_type=allocator,
            device_capacity_tokens=dev.size,
            start_layer=0,
            end_layer=L,
            target_layer_num=L,
            override_kv_cache_dim=dev.kv_cache_dim,
        )
        decl = make_dsa_indexer_pool_decl(dev)  # SGLang's own declaration: indices from KV
        index_host = DSAIndexerPoolHost(
            decl=decl, anchor_host=kv_host, pin_memory=False, allocator_type=allocator
        )
        layers = {i: i for i in range(L)}
        group = HostPoolGroup(
            [
                build_pool_entry(
                    name=PoolName.KV,
                    host_pool=kv_host,
                    device_pool=dev,
                    layer_mapping=layers,
                    transfer_layer_id_max=L,
                    is_anchor=True,
                ),
                build_pool_entry(
                    name=PoolName.INDEXER,
                    host_pool=index_host,
                    device_pool=dev,
                    layer_mapping=layers,
                    transfer_layer_id_max=L,
                ),
            ]
        )
        ctl, inner = controller_driver.hicache_controller(
            HybridCacheController,
            self.dist,
            alloc,
            group,
            P,
            "tiny-dsa",
            extra,
            transfer_layer_id_max=L,
        )
        self.controllers[name] = {
            "dev": dev,
            "alloc": alloc,
            "kv_host": kv_host,
            "index_host": index_host,
            "group": group,
            "ctl": ctl,
            "backend": inner,
            "layout": layout,
        }
        attached = inner.attached
        return {
            "attached": attached is not None,
            "refused": inner.refused,
            "side_pools": inner.side_pools,
            "indexer_group": None if attached is None else attached.groups().get("indexer"),
        }

    # ---- reference bytes and where they sit ----------------------------------------------

    def _ref(self, seed: int, pages: int) -> tuple[list[Any], list[Any]]:
        """Per layer the latents [pages*P, 1, LATENT] and index pages [pages, INDEX_PAGE]
        (page i from the seed and i alone: a longer prompt of a seed extends a shorter one)."""
        torch = self.torch
        latents: list[list[Any]] = [[] for _ in range(L)]
        index: list[list[Any]] = [[] for _ in range(L)]
        for page in range(pages):
            gen = torch.Generator().manual_seed(seed * 1000 + page)
            for layer in range(L):
                latents[layer].append(torch.randn((P, 1, LATENT), generator=gen).bfloat16())
                index[layer].append(
                    torch.randint(0, 256, (1, INDEX_PAGE), generator=gen, dtype=torch.uint8)
                )
        return [torch.cat(x) for x in latents], [torch.cat(x) for x in index]

    @staticmethod
    def _pages(indices: Any) -> list[int]:
        return [int(t) // P for t in indices[::P]]

    def _host_latents(self, c: dict[str, Any], idx: Any, layer: int) -> Any:
        buf = c["kv_host"].kv_buffer
        if c["layout"] == "layer_first":
            return buf[layer][idx]
        return self.torch.stack([buf[int(t) // P, layer, int(t) % P] for t in idx])

    def _host_index(self, c: dict[str, Any], idx: Any, layer: int) -> Any:
        buf = c["index_host"].index_k_with_scale_buffer
        pages = self._pages(idx)
        if c["layout"] == "layer_first":
            return buf[layer][pages]
        return buf[pages, layer, 0]

    def _host_ok(self, c: dict[str, Any], idx: Any, latents: list[Any], index: list[Any]) -> bool:
        eq, n = self.torch.equal, len(idx)
        return all(
            eq(self._host_latents(c, idx, layer), latents[layer][:n])
            and eq(self._host_index(c, idx, layer), index[layer][: n // P])
            for layer in range(L)
        )

    def _dev_ok(self, c: dict[str, Any], idx: Any, latents: list[Any], index: list[Any]) -> bool:
        dev, eq, n = c["dev"], self.torch.equal, len(idx)
        pages = self._pages(idx)
        return all(
            eq(dev.kv_buffer[layer][idx], latents[layer][:n])
            and eq(dev.index_k_with_scale_buffer[layer][pages], index[layer][: n // P])
            for layer in range(L)
        )

    def _clear(self, c: dict[str, Any], host_idx: Any, dev_idx: Any) -> None:
        c["group"].free(host_idx)
        c["kv_host"].kv_buffer.zero_()
        c["index_host"].index_k_with_scale_buffer.zero_()
        dev = c["dev"]
        for layer in range(L):
            dev.kv_buffer[layer][dev_idx] = 0
            dev.index_k_with_scale_buffer[layer][self._pages(dev_idx)] = 0
        c["alloc"].free(dev_idx)

    @staticmethod
    def _indexer() -> Any:
        """The INDEXER transfer SGLang's cache adds beside a KV transfer (its spec's)."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        return PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV)

    # ---- the commands --------------------------------------------------------------------

    def fill(self, name: str, seed: int, pages: int) -> dict[str, Any]:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        c = self.controllers[name]
        ctl, dev = c["ctl"], c["dev"]
        latents, index = self._ref(seed, pages)
        dev_idx = c["alloc"].alloc(P * pages)
        dev_pages = self._pages(dev_idx)
        for layer in range(L):
            dev.kv_buffer[layer][dev_idx] = latents[layer]
            dev.index_k_with_scale_buffer[layer][dev_pages] = index[layer]
        host_idx = ctl.write(device_indices=dev_idx, node_id=seed, extra_pools=[self._indexer()])
        ctl.start_writing()
        ack = ctl.ack_write_queue.pop(0)
        ack.finish_event.synchronize()
        l1_l2_ok = self._host_ok(c, host_idx, latents, index)
        tokens = tokens_of(seed, pages)
        hashes = get_storage_hash_str(tokens, None, page_size=P)
        ctl.write_storage(host_idx, tokens, hash_value=hashes, extra_pools=[self._indexer()])
        op = ctl.ack_backup_queue.get(timeout=120)
        stored = op.pool_storage_result.extra_pool_hit_pages.get("indexer", 0)
        self._clear(c, host_idx, dev_idx)
        return {
            "l1_l2_ok": l1_l2_ok,
            "backed_up_tokens": int(op.completed_tokens),
            "indexer_stored": int(stored),
        }

    def fetch(self, name: str, seed: int, pages: int) -> dict[str, Any]:
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        c = self.controllers[name]
        ctl = c["ctl"]
        latents, index = self._ref(seed, pages)
        rid = f"req-{seed}-{time.monotonic_ns()}"
        ctl.prefetch(
            CacheRequestHandle(rid, 0), tokens_of(seed, pages), extra_pools=[self._indexer()]
        )
        hit = ctl.prefetch_hit_queue.get(timeout=120)
        out: dict[str, Any] = {
            "hit_pages": int(hit.storage_hit_count) // P,
            "fetched_tokens": 0,
            "indexer_hits": None,
            "match": None,
        }
        if out["hit_pages"] == 0:
            return out
        host_idx, fetched, _ = controller_driver.prefetch_hit(ctl, hit)
        out["fetched_tokens"] = fetched
        if fetched == 0:
            c["group"].free(host_idx)
            return out
        got = host_idx[:fetched]
        host_ok = self._host_ok(c, got, latents, index)
        dev_idx = ctl.load(host_indices=got, node_id=seed + 100000, extra_pools=[self._indexer()])
        ctl.start_loading()
        ack = ctl.ack_load_queue.pop(0)
        ack.finish_event.synchronize()
        out["match"] = host_ok and self._dev_ok(c, dev_idx, latents, index)
        self._clear(c, host_idx, dev_idx)
        return out

    def stop(self, name: str) -> dict[str, Any]:
        c = self.controllers.pop(name)
        c["backend"].close()
        return {"stopped": True, "attached": c["backend"].attached is not None}


if __name__ == "__main__":
    raise SystemExit(controller_driver.main(DsaHarness))
