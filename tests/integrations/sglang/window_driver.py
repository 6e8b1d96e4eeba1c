"""`hybrid_driver` plus SGLang's hybrid-SWA pools: a `HybridCacheController` whose
`HostPoolGroup` holds the full-attention KV host pool and an SWA side pool (a KV host pool of
the sliding layers; a tiny gpt-oss: `hybrid_harness.tiny_gpt_oss`), driven as SGLang's SWA
component drives it (`unified_cache/components/swa.py`: a node's window pages backed up with
their trailing keys, the prefetch's placeholder keys of one window, the staging of
min(window, hit) pages). The process `hybrid_harness.HybridControllers` starts; commands as
`hybrid_driver`'s, and:
    {"op": "start_window", "name", "extra"}  a KV + SWA controller -> as "start"
    {"op": "fill_window", "name", "seed", "pages", "window_pages"}  seeded KV and SWA pages
        (page i's from (seed, i) alone) device -> host (both pools) -> hicache, the SWA pool's
        last `window_pages` pages backed up with their keys -> {"l1_l2_ok",
        "backed_up_tokens", "window_stored"}; then host and device cleared
    {"op": "get_window", "name", "seed", "pages", "window"}  `batch_get_v2` of the last
        `window` SWA pages into fresh zeroed host slots -> {"result", "unwritten_pages"}
    {"op": "malformed", "name"}  v2 calls with transfers SGLang should not send -> each result
    {"op": "fetch_window", "name", "seed", "pages", "window"?}  hit query with an SWA window
        of `window` pages (default the model's, `WINDOW_PAGES`),
        host slots of both, page transfer, acks, load of both -> {"hit_pages", "restorable",
        "fetched_tokens", "window_fetched", "kv_match", "window_match"} (window_match: the
        device's SWA pages equal the hit's last pages of the window, None when none loaded)
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tests.integrations.sglang import controller_driver
from tests.integrations.sglang.hybrid_driver import (
    DEVICE_PAGES,
    FULL_LAYERS,
    HOST_RATIO,
    D,
    H,
    Harness,
    P,
    main,
    tokens_of,
)

SWA_LAYERS = (0, 2)  # gpt-oss: sliding first, then full, alternating
WINDOW_PAGES = 4  # sliding_window 64 tokens of 16-token pages


class WindowHarness(Harness):
    def start_window(self, name: str, extra: dict[str, Any]) -> dict[str, Any]:
        torch = self.torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        def pools(layers: int) -> tuple[Any, Any, Any]:
            dev = MHATokenToKVPool(
                size=P * DEVICE_PAGES,
                page_size=P,
                dtype=torch.bfloat16,
                head_num=H,
                head_dim=D,
                layer_num=layers,
                device="cpu",
                enable_memory_saver=False,
                start_layer=0,
                end_layer=layers,
            )
            alloc = PagedTokenToKVPoolAllocator(
                P * DEVICE_PAGES, P, torch.bfloat16, "cpu", dev, need_sort=False
            )
            host = MHATokenToKVPoolHost(
                dev.get_device_pool_infos()[0].buffer_info,
                HOST_RATIO,
                0,
                P,
                "page_first_direct",
                pin_memory=False,
                device="cpu",
                device_capacity_tokens=dev.size,
                start_layer=0,
                end_layer=layers,
                write_back_staging=dev.hicache_write_back_staging,
            )
            return dev, alloc, host

        dev, alloc, kv_host = pools(len(FULL_LAYERS))
        swa_dev, swa_alloc, swa_host = pools(len(SWA_LAYERS))
        span = len(FULL_LAYERS) + len(SWA_LAYERS)
        group = HostPoolGroup(
            [
                build_pool_entry(
                    name=PoolName.KV,
                    host_pool=kv_host,
                    device_pool=dev,
                    layer_mapping={g: i for i, g in enumerate(FULL_LAYERS)},
                    transfer_layer_id_max=span,
                    is_anchor=True,
                ),
                build_pool_entry(
                    name=PoolName.SWA,
                    host_pool=swa_host,
                    device_pool=swa_dev,
                    layer_mapping={g: i for i, g in enumerate(SWA_LAYERS)},
                    transfer_layer_id_max=span,
                    device_alloc_fn=swa_alloc.alloc,
                    device_free_fn=swa_alloc.free,
                ),
            ]
        )
        ctl, inner = controller_driver.hicache_controller(
            HybridCacheController,
            self.dist,
            alloc,
            group,
            P,
            "tiny-gpt-oss",
            extra,
            transfer_layer_id_max=span,
        )
        self.controllers[name] = {
            "dev": dev,
            "alloc": alloc,
            "kv_host": kv_host,
            "swa_dev": swa_dev,
            "swa_alloc": swa_alloc,
            "swa_host": swa_host,
            "group": group,
            "ctl": ctl,
            "backend": inner,
        }
        return {
            "attached": inner.attached is not None,
            "refused": inner.refused,
            "side_pools": inner.side_pools,
            "swa_group": None if inner.attached is None else inner.attached.swa_group,
        }

    def _swa(self, seed: int, pages: int) -> tuple[list[Any], list[Any]]:
        """Per SWA layer K and V of the prompt's pages; page i from (seed, i) alone."""
        return self._kv(seed + 500, pages)

    def _rows(self, pool: Any, idx: Any, layers: int, ks: list[Any], vs: list[Any]) -> bool:
        eq = self.torch.equal
        return all(
            eq(pool.k_buffer[layer][idx], ks[layer]) and eq(pool.v_buffer[layer][idx], vs[layer])
            for layer in range(layers)
        )

    def _clear_window(self, c: dict[str, Any], host_idx: Any, dev_idx: Any, swa: Any) -> None:
        host_swa, dev_swa = swa
        c["group"].free(host_idx)
        c["kv_host"].kv_buffer.zero_()
        if host_swa is not None:
            c["group"].free(host_swa, pool="swa")
        c["swa_host"].kv_buffer.zero_()
        for pool, alloc, idx in (
            (c["dev"], c["alloc"], dev_idx),
            (c["swa_dev"], c["swa_alloc"], dev_swa),
        ):
            if idx is None or idx.numel() == 0:
                continue
            for layer in range(len(pool.k_buffer)):
                pool.k_buffer[layer][idx] = 0
                pool.v_buffer[layer][idx] = 0
            alloc.free(idx)

    def fill_window(self, name: str, seed: int, pages: int, window_pages: int) -> dict[str, Any]:
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        c = self.controllers[name]
        ctl = c["ctl"]
        ks, vs = self._kv(seed, pages)
        sks, svs = self._swa(seed, pages)
        dev_idx = c["alloc"].alloc(P * pages)
        swa_idx = c["swa_alloc"].alloc(P * pages)
        for layer in range(len(FULL_LAYERS)):
            c["dev"].k_buffer[layer][dev_idx] = ks[layer]
            c["dev"].v_buffer[layer][dev_idx] = vs[layer]
        for layer in range(len(SWA_LAYERS)):
            c["swa_dev"].k_buffer[layer][swa_idx] = sks[layer]
            c["swa_dev"].v_buffer[layer][swa_idx] = svs[layer]
        side = PoolTransfer(name=PoolName.SWA, device_indices=swa_idx)
        host_idx = ctl.write(device_indices=dev_idx, node_id=seed, extra_pools=[side])
        ctl.start_writing()
        ack = ctl.ack_write_queue.pop(0)
        ack.finish_event.synchronize()
        l1_l2_ok = self._host_kv_ok(c, host_idx, ks, vs)
        tokens = tokens_of(seed, pages)
        hashes = get_storage_hash_str(tokens, None, page_size=P)
        n = window_pages
        backup = [
            PoolTransfer(
                name=PoolName.SWA,
                host_indices=side.host_indices[-n * P :],
                keys=hashes[-n:],
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            )
        ]
        ctl.write_storage(host_idx, tokens, hash_value=hashes, extra_pools=backup)
        op = ctl.ack_backup_queue.get(timeout=120)
        stored = op.pool_storage_result.extra_pool_hit_pages.get("swa", 0)
        self._clear_window(c, host_idx, dev_idx, (side.host_indices, swa_idx))
        return {
            "l1_l2_ok": l1_l2_ok,
            "backed_up_tokens": int(op.completed_tokens),
            "window_stored": int(stored),
        }

    def fetch_window(
        self, name: str, seed: int, pages: int, window: int = WINDOW_PAGES
    ) -> dict[str, Any]:
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        torch = self.torch
        c = self.controllers[name]
        ctl = c["ctl"]
        side = PoolTransfer(
            name=PoolName.SWA,
            keys=["__placeholder__"] * window,
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        )
        rid = f"req-{seed}-{time.monotonic_ns()}"
        ctl.prefetch(CacheRequestHandle(rid, 0), tokens_of(seed, pages), extra_pools=[side])
        hit = ctl.prefetch_hit_queue.get(timeout=120)
        hit_pages = int(hit.storage_hit_count) // P
        restorable = hit.pool_storage_result.restorable_prefix_pages
        out: dict[str, Any] = {
            "hit_pages": hit_pages,
            "restorable": None if restorable is None else list(restorable),
            "fetched_tokens": 0,
            "window_fetched": 0,
            "kv_match": None,
            "window_match": None,
        }
        if hit_pages == 0:
            return out
        n = min(window, hit_pages)  # the SWA staging, as the scheduler sizes it

        def window_slots() -> None:
            side.host_indices = c["group"].alloc(n * P, pool=PoolName.SWA)

        host_idx, fetched, pool_hits = controller_driver.prefetch_hit(ctl, hit, window_slots)
        if pool_hits:
            out["window_fetched"] = pool_hits.get("swa", 0)
        out["fetched_tokens"] = fetched
        empty = torch.empty(0, dtype=torch.int64)
        if fetched == 0:
            self._clear_window(c, host_idx, empty, (side.host_indices, empty))
            return out
        got = host_idx[:fetched]
        ks, vs = self._kv(seed, pages)
        host_ok = self._host_kv_ok(c, got, ks, vs)
        swa_dev = c["swa_alloc"].alloc(n * P)
        load_side = PoolTransfer(
            name=PoolName.SWA, host_indices=side.host_indices, device_indices=swa_dev
        )
        dev_idx = ctl.load(host_indices=got, node_id=seed + 100000, extra_pools=[load_side])
        ctl.start_loading()
        ack = ctl.ack_load_queue.pop(0)
        ack.finish_event.synchronize()
        kv_ref = ([k[:fetched] for k in ks], [v[:fetched] for v in vs])
        out["kv_match"] = host_ok and self._rows(c["dev"], dev_idx, len(FULL_LAYERS), *kv_ref)
        if out["window_fetched"]:
            sks, svs = self._swa(seed, hit_pages)
            lo = (hit_pages - n) * P
            window = ([k[lo:] for k in sks], [v[lo:] for v in svs])
            out["window_match"] = self._rows(c["swa_dev"], swa_dev, len(SWA_LAYERS), *window)
        self._clear_window(c, host_idx, dev_idx, (side.host_indices, swa_dev))
        return out

    def get_window(self, name: str, seed: int, pages: int, window: int) -> dict[str, Any]:
        """`batch_get_v2` of the prompt's last `window` SWA pages straight into fresh,
        zeroed SWA host slots, as SGLang's prefetch IO thread calls it -> {"result" (the
        call's booleans), "unwritten_pages" (pages of those slots still all zero)}."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        c = self.controllers[name]
        hashes = get_storage_hash_str(tokens_of(seed, pages), None, page_size=P)
        host = c["group"].alloc(window * P, pool=PoolName.SWA)
        buf = c["swa_host"].kv_buffer
        buf.zero_()
        transfer = PoolTransfer(name=PoolName.SWA, host_indices=host, keys=hashes[-window:])
        got = c["backend"].batch_get_v2([transfer])
        firsts = host[::P].tolist()
        unwritten = sum(1 for t in firsts if not bool(buf[:, int(t) // P].any()))
        c["group"].free(host, pool="swa")
        buf.zero_()
        return {"result": got["swa"], "unwritten_pages": unwritten}

    def malformed(self, name: str) -> dict[str, Any]:
        """The backend's v2 calls with transfers SGLang should not send (no slots, slots that
        do not match the keys, a pool not mapped, no keys): each answers "absent" / "not
        stored" (lists of False, no hit), never an exception."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        torch = self.torch
        backend = self.controllers[name]["backend"]
        trailing = PoolHitPolicy.TRAILING_PAGES
        transfers = [
            PoolTransfer(name=PoolName.MAMBA, keys=["a" * 64], host_indices=None),
            PoolTransfer(
                name=PoolName.MAMBA, keys=["a" * 64, "b" * 64], host_indices=torch.tensor([0])
            ),
            PoolTransfer(name=PoolName.SWA, keys=["c" * 64], host_indices=None),
            PoolTransfer(name=PoolName.SWA, keys=["c" * 64], host_indices=torch.tensor([3])),
            PoolTransfer(name=PoolName.INDEXER, keys=["d" * 64], host_indices=torch.tensor([0])),
            PoolTransfer(name=PoolName.MAMBA, keys=None, host_indices=None),
        ]
        out: dict[str, Any] = {"get": [], "set": []}
        for t in transfers:
            out["get"].append(backend.batch_get_v2([t]))
            out["set"].append(backend.batch_set_v2([t]))
        exists = backend.batch_exists_v2(
            ["e" * 64] * 3,
            [PoolTransfer(name=PoolName.INDEXER, keys=["e" * 64], hit_policy=trailing)],
        )
        out["exists_unmapped"] = [exists.kv_hit_pages, exists.restorable_prefix_pages]
        exists = backend.batch_exists_v2(
            [], [PoolTransfer(name=PoolName.MAMBA, hit_policy=trailing)]
        )
        out["exists_empty"] = [exists.kv_hit_pages, exists.restorable_prefix_pages]
        return out


if __name__ == "__main__":
    sys.exit(main(WindowHarness))
