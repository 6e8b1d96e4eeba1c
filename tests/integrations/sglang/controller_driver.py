"""SGLang's own `HiCacheController` and host pool, without the engine, with hicache's storage
backend, in a process of its own (the SGLang environment; `controller_harness.Controllers`
starts it). What SGLang's scheduler would do around them is done here step by step.

    python -m tests.integrations.sglang.controller_driver

Lifecycle: starting (imports: 15-25 s) -> ready (`{"ready": s}` on stdout) -> serving (one
JSON command a line on stdin, one JSON reply a line on stdout) -> stopped (EOF). Commands:
    {"op": "start", "name", "layout", "extra": {extra config}, "model": "mha" | "mla"}  a
        controller (device pool of DEVICE_PAGES pages — MHA: K and V of H heads; MLA: one
        latent of MLA_LATENT — host pool, controller) -> {"attached", "refused", "side_pools"}
    {"op": "fill", "name", "seed", "pages"}   seeded KV into device pages, L1 -> L2 (write),
        L2 -> L3 (write_storage) -> {"l1_l2_ok", "backed_up_tokens"}; then L1 and L2 cleared
    {"op": "fetch", "name", "seed", "pages"}  L3 -> L2 (prefetch: hit query, host slots,
        page transfer, acks as the scheduler drains them) -> L2 -> L1 (load), compared with
        the seed's KV -> {"hit_pages", "fetched_tokens", "match"} (match: the fetched prefix
        byte-exact in the host pool and on the device; None when nothing was fetched)
    {"op": "stats", "name"} -> the backend's totals, link counters, `get_stats()` pages
    {"op": "stop", "name"}  the controller detaches its backend (`close()`)
Any exception answers {"error": ...}; the process serves on (a crash is the test's failure).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

L, P, H, D = 4, 16, 2, 64  # layers, page size, KV heads, head dim (the tests' model config)
MLA_RANK, MLA_ROPE = 64, 32  # the MLA model's kv_lora_rank and qk_rope_head_dim
MLA_LATENT = MLA_RANK + MLA_ROPE
DEVICE_PAGES = 32
HOST_RATIO = 2.0  # the host pool: twice the device pool
TP_ENV = "SGLANG_DRIVER_TP_RANK_SIZE"  # "rank/size" this driver plays (default 0/1)


def tokens_of(seed: int, pages: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 3 for i in range(pages * P)]


BACKEND = {  # SGLang's `dynamic` storage backend, pointed at hicache's
    "backend_name": "hicache",
    "module_path": "hicache.integrations.sglang",
    "class_name": "HicacheStorage",
    "interface_v1": 1,
}


def hicache_controller(
    cls: Any,
    dist: Any,
    alloc: Any,
    pool: Any,
    page: int,
    model_name: str,
    extra: dict[str, Any],
    **more: Any,
) -> tuple[Any, Any]:
    """SGLang's controller `cls` (`HiCacheController`, `HybridCacheController`) over `pool`
    with hicache's storage backend (`BACKEND` | `extra`), write-through and direct IO as the
    tests drive it; and the backend itself (SGLang's failure injector may wrap it)."""
    ctl = cls(
        alloc,
        pool,
        page,
        dist.group.WORLD,
        load_cache_event=threading.Event(),
        write_policy="write_through",
        io_backend="direct",
        storage_backend="dynamic",
        prefetch_threshold=page,
        model_name=model_name,
        storage_backend_extra_config=BACKEND | extra,
        **more,
    )
    backend = ctl.storage_backend
    return ctl, getattr(backend, "_backend", backend)


def prefetch_hit(
    ctl: Any, hit: Any, side_slots: Callable[[], None] | None = None
) -> tuple[Any, int, dict[str, int]]:
    """What SGLang's scheduler does with a prefetch hit: host slots for it (and, by
    `side_slots`, for its side pools), the page transfer queued, its acks drained -> (the
    host slots, the tokens it fetched, the side pools' hits the acks reported)."""
    host_idx = ctl.alloc_prefetch_host_buffers(hit, hit.storage_hit_count)
    if side_slots is not None:
        side_slots()
    hit.host_indices = host_idx
    ctl.prefetch_buffer.put(hit)
    fetched, done, pool_hits = 0, False, {}
    while not done:
        ack = ctl.ack_prefetch_queue.get(timeout=120)
        if ack.completed_tokens is not None:
            fetched = max(fetched, int(ack.completed_tokens))
        if ack.pool_hits:
            pool_hits = {str(getattr(k, "value", k)): int(v) for k, v in ack.pool_hits.items()}
        done = bool(ack.completed_req)
    return host_idx, fetched, pool_hits


def host_pool(cls: Any, dev: Any, layout: str, **extra: Any) -> Any:
    """SGLang's host pool `cls` mirroring device pool `dev` (from its buffer info, as SGLang's
    pool assembler builds it), HOST_RATIO times its size, unpinned, in `layout`."""
    return cls(
        dev.get_device_pool_infos()[0].buffer_info,
        HOST_RATIO,
        0,
        P,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev.size,
        start_layer=dev.start_layer,
        end_layer=dev.end_layer,
        **extra,
    )


class Harness:
    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", rank=0, world_size=1)
        from sglang.srt.runtime_context import get_parallel

        # this process as one TP rank of several (`Controllers(..., tp=(rank, size))`): what
        # SGLang's storage config and the backend see; the process group stays this process
        rank, size = (int(n) for n in os.environ.get(TP_ENV, "0/1").split("/"))
        get_parallel().override_permanently(
            tp_rank=rank,
            tp_size=size,
            pp_rank=0,
            pp_size=1,
            attn_tp_rank=rank,
            attn_tp_size=size,
            attn_cp_rank=0,
            attn_cp_size=1,
            attn_dcp_rank=0,
            attn_dcp_size=1,
        )
        from sglang.srt.managers.cache_controller import HiCacheController  # noqa: F401
        from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: F401

        self.torch, self.dist = torch, dist
        self.controllers: dict[str, dict[str, Any]] = {}

    def start(
        self, name: str, layout: str, extra: dict[str, Any], model: str = "mha"
    ) -> dict[str, Any]:
        torch = self.torch
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

        dev, host = self._mla_pools(layout) if model == "mla" else self._mha_pools(layout)
        alloc = PagedTokenToKVPoolAllocator(
            P * DEVICE_PAGES, P, torch.bfloat16, "cpu", dev, need_sort=False
        )
        ctl, inner = hicache_controller(
            HiCacheController,
            self.dist,
            alloc,
            host,
            P,
            "tiny",
            extra,
        )
        self.controllers[name] = {
            "dev": dev,
            "alloc": alloc,
            "host": host,
            "ctl": ctl,
            "backend": inner,
            "layout": layout,
            "model": model,
        }
        return {
            "attached": inner.attached is not None,
            "refused": inner.refused,
            "side_pools": inner.side_pools,
            "backend": type(inner).__name__,
        }

    def _mla_pools(self, layout: str) -> tuple[Any, Any]:
        """SGLang's MLA device pool and its host mirror, as SGLang's pool assembler builds
        them (`hybrid_pool_assembler`: the host pool from the device pool's buffer info)."""
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        dev = MLATokenToKVPool(
            size=P * DEVICE_PAGES,
            page_size=P,
            dtype=self.torch.bfloat16,
            kv_lora_rank=MLA_RANK,
            qk_rope_head_dim=MLA_ROPE,
            layer_num=L,
            device="cpu",
            enable_memory_saver=False,
            start_layer=0,
            end_layer=L,
        )
        host = host_pool(
            MLATokenToKVPoolHost,
            dev,
            layout,
            target_layer_num=dev.layer_num,
            override_kv_cache_dim=dev.kv_cache_dim,
        )
        return dev, host

    def _mha_pools(self, layout: str) -> tuple[Any, Any]:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        torch = self.torch
        dev = MHATokenToKVPool(
            size=P * DEVICE_PAGES,
            page_size=P,
            dtype=torch.bfloat16,
            head_num=H,
            head_dim=D,
            layer_num=L,
            device="cpu",
            enable_memory_saver=False,
            start_layer=0,
            end_layer=L,
        )
        host = host_pool(
            MHATokenToKVPoolHost, dev, layout, write_back_staging=dev.hicache_write_back_staging
        )
        return dev, host

    @staticmethod
    def _parts(c: dict[str, Any]) -> int:
        """Tensors a token has per layer: K and V (MHA), the latent (MLA)."""
        return 1 if c["model"] == "mla" else 2

    @staticmethod
    def _dev(c: dict[str, Any], part: int, layer: int) -> Any:
        dev = c["dev"]
        if c["model"] == "mla":
            return dev.kv_buffer[layer]
        return (dev.k_buffer, dev.v_buffer)[part][layer]

    def _ref(self, c: dict[str, Any], seed: int, pages: int) -> list[list[Any]]:
        """The seed's tensors, [part][layer] (`_parts`), each of `pages` pages of tokens."""
        torch = self.torch
        gen = torch.Generator().manual_seed(seed)
        shape = (pages * P, 1, MLA_LATENT) if c["model"] == "mla" else (pages * P, H, D)
        return [
            [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(L)]
            for _ in range(self._parts(c))
        ]

    def _host_rows(self, c: dict[str, Any], idx: Any, layer: int, part: int) -> Any:
        host, layout = c["host"], c["layout"]
        buf = host.kv_buffer if c["model"] == "mla" else host.kv_buffer[part]
        if layout == "page_first_direct":
            return self.torch.stack([buf[int(t) // P, layer, int(t) % P] for t in idx])
        if layout == "layer_first":
            return buf[layer][idx]
        return buf[idx, layer]  # page_first

    def _host_ok(self, c: dict[str, Any], idx: Any, ref: list[list[Any]]) -> bool:
        return all(
            self.torch.equal(self._host_rows(c, idx, layer, part), ref[part][layer][: len(idx)])
            for part in range(self._parts(c))
            for layer in range(L)
        )

    def _clear(self, c: dict[str, Any], host_idx: Any, dev_idx: Any) -> None:
        c["host"].free(host_idx)
        c["host"].kv_buffer.zero_()
        for part in range(self._parts(c)):
            for layer in range(L):
                self._dev(c, part, layer)[dev_idx] = 0
        c["alloc"].free(dev_idx)

    def fill(self, name: str, seed: int, pages: int) -> dict[str, Any]:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        c = self.controllers[name]
        ctl = c["ctl"]
        ref = self._ref(c, seed, pages)
        dev_idx = c["alloc"].alloc(P * pages)
        for part in range(self._parts(c)):
            for layer in range(L):
                self._dev(c, part, layer)[dev_idx] = ref[part][layer]
        host_idx = ctl.write(device_indices=dev_idx, node_id=seed)
        ctl.start_writing()
        ack = ctl.ack_write_queue.pop(0)
        ack.finish_event.synchronize()
        l1_l2_ok = self._host_ok(c, host_idx, ref)
        tokens = tokens_of(seed, pages)
        hashes = get_storage_hash_str(tokens, None, page_size=P)
        ctl.write_storage(host_idx, tokens, hash_value=hashes)
        op = ctl.ack_backup_queue.get(timeout=120)
        self._clear(c, host_idx, dev_idx)
        return {"l1_l2_ok": l1_l2_ok, "backed_up_tokens": int(op.completed_tokens)}

    def fetch(self, name: str, seed: int, pages: int) -> dict[str, Any]:
        c = self.controllers[name]
        ctl = c["ctl"]
        ref = self._ref(c, seed, pages)
        ctl.prefetch(f"req-{seed}-{time.monotonic_ns()}", tokens_of(seed, pages), last_hash=None)
        hit = ctl.prefetch_hit_queue.get(timeout=120)
        hit_pages = int(hit.storage_hit_count) // P
        if hit_pages == 0:
            return {"hit_pages": 0, "fetched_tokens": 0, "match": None}
        host_idx, fetched, _ = prefetch_hit(ctl, hit)
        if fetched == 0:
            c["host"].free(host_idx)
            return {"hit_pages": hit_pages, "fetched_tokens": 0, "match": None}
        got = host_idx[:fetched]
        host_ok = self._host_ok(c, got, ref)
        dev_idx = ctl.load(host_indices=got, node_id=seed + 100000)
        ctl.start_loading()
        ack = ctl.ack_load_queue.pop(0)
        ack.finish_event.synchronize()
        dev_ok = all(
            self.torch.equal(self._dev(c, part, layer)[dev_idx], ref[part][layer][:fetched])
            for part in range(self._parts(c))
            for layer in range(L)
        )
        self._clear(c, host_idx, dev_idx)
        return {"hit_pages": hit_pages, "fetched_tokens": fetched, "match": host_ok and dev_ok}

    def stats(self, name: str) -> dict[str, Any]:
        backend = self.controllers[name]["backend"]
        metrics = backend.get_stats()
        return {
            "totals": dict(backend.stats.totals),
            "link": vars(backend.link.counters),
            "up": backend.link.up,
            "metrics_prefetch_pgs": list(metrics.prefetch_pgs) if metrics else None,
            "metrics_backup_pgs": list(metrics.backup_pgs) if metrics else None,
        }

    def stop(self, name: str) -> dict[str, Any]:
        c = self.controllers.pop(name)
        c["backend"].close()
        return {"stopped": True, "attached": c["backend"].attached is not None}


def main(kind: type[Harness] = Harness) -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    started = time.perf_counter()
    harness = kind()
    out.write(json.dumps({"ready": time.perf_counter() - started}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            reply = getattr(harness, op)(**command)
        except Exception as exc:
            traceback.print_exc()
            reply = {"error": f"{op}: {type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
