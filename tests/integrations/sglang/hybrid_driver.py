"""SGLang's own `HybridCacheController` with a `HostPoolGroup` of the KV host pool and a
`MambaPoolHost` side pool (a tiny Qwen3-Next: `hybrid_harness.tiny_qwen3_next`), without the
engine, with hicache's storage backend, in a process of its own (the SGLang environment;
`hybrid_harness.HybridControllers` starts it). What SGLang's scheduler and its Mamba component
would do around them (`unified_cache/components/mamba.py`: the state's host slot, its one
trailing key, the prefetch's placeholder transfer) is done here step by step.

    python -m tests.integrations.sglang.hybrid_driver

Lifecycle: starting (imports) -> ready (`{"ready": s}`) -> serving (one JSON command a line on
stdin, one JSON reply a line on stdout) -> stopped (EOF). Commands:
    {"op": "start", "name", "allocator", "extra", "variant"}  a controller -> {"attached",
        "refused", "side_pools", "state_group"}; variant "mamba" (the model's pools), "kv_only"
        (no Mamba side pool registered), "bf16_state" (its SSM state in bfloat16: not the
        sidecar's float32)
    {"op": "fill", "name", "seed", "pages", "state"}  seeded KV pages (page i's bytes depend on
        the seed and i only: a longer prompt of a seed extends a shorter one) and, with
        `state`, the Mamba state after `pages` pages: device -> host (write, both pools) ->
        hicache (write_storage; the state as SGLang's backup sends it) -> {"l1_l2_ok",
        "backed_up_tokens", "state_stored"}; then host and device cleared
    {"op": "fetch", "name", "seed", "pages"}  hit query, host slots (KV and the state's),
        page transfer, acks, then host -> device load of both pools -> {"hit_pages",
        "restorable", "fetched_tokens", "state_fetched", "kv_match", "state_from"}: state_from
        is the length whose stored state the device holds byte-exact (None: none matches)
    {"op": "three_threads", "name", "seed", "pages", "rounds"}  exists_v2, set_v2 and get_v2
        from three threads at once on one backend -> per op the rounds answered right
    {"op": "attach_order", "name"}  a fresh backend over that controller's pools, the data
        path tried at each step of SGLang's attach order -> per step the calls' results
    {"op": "stop", "name"}  the backend detaches (`close()`)
Any exception answers {"error": ...}; the process serves on.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from types import SimpleNamespace
from typing import Any

from tests.integrations.sglang import controller_driver

P, H, D = 16, 2, 64  # page size, KV heads, head dim
FULL_LAYERS, MAMBA_LAYERS = (1, 3), (0, 2)  # full_attention_interval 2 of 4 layers
CONV, TEMPORAL = (256, 3), (4, 32, 32)  # 2*2*32 + 4*32 channels x (kernel - 1); heads x k x v
DEVICE_PAGES, DEVICE_SLOTS = 32, 8
HOST_RATIO = 2.0


def tokens_of(seed: int, pages: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 3 for i in range(pages * P)]


class Harness:
    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", rank=0, world_size=1)
        from sglang.srt.runtime_context import get_parallel

        get_parallel().override_permanently(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_tp_rank=0,
            attn_tp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            attn_dcp_rank=0,
            attn_dcp_size=1,
        )
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: F401
            HybridCacheController,
        )

        self.torch, self.dist = torch, dist
        self.controllers: dict[str, dict[str, Any]] = {}

    def start(
        self, name: str, allocator: str, extra: dict[str, Any], variant: str = "mamba"
    ) -> dict[str, Any]:
        torch = self.torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
        from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        layers = len(FULL_LAYERS)
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
        kv_host = MHATokenToKVPoolHost(
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
        mamba = len(MAMBA_LAYERS)
        ssm_dtype = torch.bfloat16 if variant == "bf16_state" else torch.float32
        temporal = torch.zeros((mamba, DEVICE_SLOTS, *TEMPORAL), dtype=ssm_dtype)
        conv = torch.zeros((mamba, DEVICE_SLOTS, *CONV), dtype=torch.bfloat16)
        mamba_dev = SimpleNamespace(temporal=temporal, conv=conv)
        mamba_host = MambaPoolHost(
            MambaStateBufferInfo(temporal=temporal, conv=(conv,)),
            HOST_RATIO,
            0,
            device_capacity=DEVICE_SLOTS,
            pin_memory=False,
            device="cpu",
            allocator_type=allocator,
            layout="page_first_direct",
        )
        span = len(FULL_LAYERS) + len(MAMBA_LAYERS)
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
            ]
        )
        if variant != "kv_only":
            group.add_entry(
                build_pool_entry(
                    name=PoolName.MAMBA,
                    host_pool=mamba_host,
                    device_pool=mamba_dev,
                    layer_mapping={g: i for i, g in enumerate(MAMBA_LAYERS)},
                    transfer_layer_id_max=span,
                )
            )
        ctl, inner = controller_driver.hicache_controller(
            HybridCacheController,
            self.dist,
            alloc,
            group,
            P,
            "tiny-qwen3-next",
            extra,
            transfer_layer_id_max=span,
        )
        self.controllers[name] = {
            "dev": dev,
            "alloc": alloc,
            "kv_host": kv_host,
            "mamba_host": mamba_host,
            "mamba_dev": mamba_dev,
            "group": group,
            "ctl": ctl,
            "backend": inner,
            "free_slots": list(range(DEVICE_SLOTS)),
        }
        return {
            "attached": inner.attached is not None,
            "refused": inner.refused,
            "side_pools": inner.side_pools,
            "state_group": None if inner.attached is None else inner.attached.state_group,
        }

    # ---- reference bytes ---------------------------------------------------------------------

    def _kv(self, seed: int, pages: int) -> tuple[list[Any], list[Any]]:
        """Per layer K and V of the prompt's pages; page i from (seed, i) alone."""
        torch = self.torch
        ks: list[list[Any]] = [[] for _ in FULL_LAYERS]
        vs: list[list[Any]] = [[] for _ in FULL_LAYERS]
        for page in range(pages):
            gen = torch.Generator().manual_seed(seed * 1000 + page)
            for layer in range(len(FULL_LAYERS)):
                ks[layer].append(torch.randn((P, H, D), generator=gen).to(torch.bfloat16))
                vs[layer].append(torch.randn((P, H, D), generator=gen).to(torch.bfloat16))
        return [torch.cat(k) for k in ks], [torch.cat(v) for v in vs]

    def _state(self, seed: int, pages: int) -> tuple[Any, Any]:
        """The Mamba state after the prompt's first `pages` pages: [layers, *shape] each."""
        torch = self.torch
        gen = torch.Generator().manual_seed(seed * 1000 + 999 + pages)
        temporal = torch.randn((len(MAMBA_LAYERS), *TEMPORAL), generator=gen)
        conv = torch.randn((len(MAMBA_LAYERS), *CONV), generator=gen).to(torch.bfloat16)
        return temporal, conv

    def _host_kv_ok(self, c: dict[str, Any], idx: Any, ks: list[Any], vs: list[Any]) -> bool:
        buf, eq = c["kv_host"].kv_buffer, self.torch.equal
        for layer in range(len(FULL_LAYERS)):
            for kv, ref in ((0, ks), (1, vs)):
                got = self.torch.stack([buf[kv][int(t) // P, layer, int(t) % P] for t in idx])
                if not eq(got, ref[layer][: len(idx)]):
                    return False
        return True

    def _host_state(self, c: dict[str, Any], slot: int) -> tuple[Any, Any]:
        host = c["mamba_host"]
        return host.temporal_buffer[slot, :, 0], host.conv_buffer[0][slot, :, 0]

    def _clear(self, c: dict[str, Any], host_idx: Any, dev_idx: Any, slots: Any) -> None:
        c["group"].free(host_idx)
        c["kv_host"].kv_buffer.zero_()
        if slots is not None:
            c["group"].free(slots, pool="mamba")
        c["mamba_host"].temporal_buffer.zero_()
        c["mamba_host"].conv_buffer[0].zero_()
        for layer in range(len(FULL_LAYERS)):
            c["dev"].k_buffer[layer][dev_idx] = 0
            c["dev"].v_buffer[layer][dev_idx] = 0
        c["alloc"].free(dev_idx)
        c["mamba_dev"].temporal.zero_()
        c["mamba_dev"].conv.zero_()

    # ---- the commands ------------------------------------------------------------------------

    def fill(self, name: str, seed: int, pages: int, state: bool) -> dict[str, Any]:
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        torch = self.torch
        c = self.controllers[name]
        dev, ctl, mdev = c["dev"], c["ctl"], c["mamba_dev"]
        ks, vs = self._kv(seed, pages)
        dev_idx = c["alloc"].alloc(P * pages)
        for layer in range(len(FULL_LAYERS)):
            dev.k_buffer[layer][dev_idx] = ks[layer]
            dev.v_buffer[layer][dev_idx] = vs[layer]
        temporal, conv = self._state(seed, pages)
        slot = 0
        mdev.temporal[:, slot] = temporal
        mdev.conv[:, slot] = conv
        side = PoolTransfer(name=PoolName.MAMBA, device_indices=torch.tensor([slot]))
        has_state = PoolName.MAMBA in c["group"].entry_map  # not in variant "kv_only"
        extra = [side] if has_state else None
        host_idx = ctl.write(device_indices=dev_idx, node_id=seed, extra_pools=extra)
        ctl.start_writing()
        ack = ctl.ack_write_queue.pop(0)
        ack.finish_event.synchronize()
        l1_l2_ok = self._host_kv_ok(c, host_idx, ks, vs)
        if has_state:
            got_t, got_c = self._host_state(c, int(side.host_indices[0]))
            l1_l2_ok = l1_l2_ok and torch.equal(got_t, temporal) and torch.equal(got_c, conv)
        state = state and has_state
        tokens = tokens_of(seed, pages)
        hashes = get_storage_hash_str(tokens, None, page_size=P)
        backup = None
        if state:  # what the Mamba component's BACKUP_STORAGE transfer is
            backup = [
                PoolTransfer(
                    name=PoolName.MAMBA,
                    host_indices=side.host_indices,
                    keys=[hashes[-1]],
                    hit_policy=PoolHitPolicy.TRAILING_PAGES,
                )
            ]
        ctl.write_storage(host_idx, tokens, hash_value=hashes, extra_pools=backup)
        op = ctl.ack_backup_queue.get(timeout=120)
        stored = op.pool_storage_result.extra_pool_hit_pages.get("mamba", 0) if state else 0
        self._clear(c, host_idx, dev_idx, side.host_indices)
        return {
            "l1_l2_ok": l1_l2_ok,
            "backed_up_tokens": int(op.completed_tokens),
            "state_stored": int(stored),
        }

    def fetch(self, name: str, seed: int, pages: int) -> dict[str, Any]:
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        torch = self.torch
        c = self.controllers[name]
        ctl, dev, mdev = c["ctl"], c["dev"], c["mamba_dev"]
        ks, vs = self._kv(seed, pages)
        side = PoolTransfer(
            name=PoolName.MAMBA, keys=["__placeholder__"], hit_policy=PoolHitPolicy.TRAILING_PAGES
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
            "state_fetched": 0,
            "kv_match": None,
            "state_from": None,
        }
        if hit_pages == 0:
            return out

        def state_slot() -> None:  # the state's host slot
            side.host_indices = c["group"].alloc(1, pool=PoolName.MAMBA)

        host_idx, fetched, pool_hits = controller_driver.prefetch_hit(ctl, hit, state_slot)
        if pool_hits:
            out["state_fetched"] = pool_hits.get("mamba", 0)
        out["fetched_tokens"] = fetched
        if fetched == 0:
            self._clear(c, host_idx, torch.empty(0, dtype=torch.int64), side.host_indices)
            return out
        got = host_idx[:fetched]
        host_ok = self._host_kv_ok(c, got, ks, vs)
        slot = 1
        load_side = PoolTransfer(
            name=PoolName.MAMBA,
            host_indices=side.host_indices,
            device_indices=torch.tensor([slot]),
        )
        dev_idx = ctl.load(host_indices=got, node_id=seed + 100000, extra_pools=[load_side])
        ctl.start_loading()
        ack = ctl.ack_load_queue.pop(0)
        ack.finish_event.synchronize()
        eq = torch.equal
        out["kv_match"] = host_ok and all(
            eq(dev.k_buffer[layer][dev_idx], ks[layer][:fetched])
            and eq(dev.v_buffer[layer][dev_idx], vs[layer][:fetched])
            for layer in range(len(FULL_LAYERS))
        )
        for length in range(1, pages + 1):  # which stored state the device now holds
            temporal, conv = self._state(seed, length)
            if eq(mdev.temporal[:, slot], temporal) and eq(mdev.conv[:, slot], conv):
                out["state_from"] = length
        self._clear(c, host_idx, dev_idx, side.host_indices)
        return out

    def three_threads(self, name: str, seed: int, pages: int, rounds: int) -> dict[str, Any]:
        """SGLang's three controller threads on one backend at once (its contract): one asks
        `batch_exists_v2` for the prompt `fill` stored, one stores the state after it under
        fresh keys (`batch_set_v2`), one loads that stored state into a host slot of its own
        (`batch_get_v2`), `rounds` times each -> per thread the rounds that answered right,
        and any exception."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        torch = self.torch
        c = self.controllers[name]
        backend, host = c["backend"], c["mamba_host"]
        keys = get_storage_hash_str(tokens_of(seed, pages), None, page_size=P)
        temporal, conv = self._state(seed, pages)
        store_slot, load_slot = c["group"].alloc(2, pool=PoolName.MAMBA).tolist()
        host.temporal_buffer[store_slot, :, 0] = temporal
        host.conv_buffer[0][store_slot, :, 0] = conv
        trailing = PoolHitPolicy.TRAILING_PAGES

        def exists(i: int) -> bool:
            ask = PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], hit_policy=trailing)
            got = backend.batch_exists_v2(keys, [ask])
            return (got.kv_hit_pages, list(got.restorable_prefix_pages or [])) == (
                pages,
                [pages],
            )

        def store(i: int) -> bool:
            key = f"{seed:032x}{i:032x}"
            slot = torch.tensor([store_slot])
            t = PoolTransfer(name=PoolName.MAMBA, keys=[key], host_indices=slot)
            return backend.batch_set_v2([t]) == {"mamba": [True]}

        def load(i: int) -> bool:
            host.temporal_buffer[load_slot].zero_()
            host.conv_buffer[0][load_slot].zero_()
            slot = torch.tensor([load_slot])
            t = PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], host_indices=slot)
            if backend.batch_get_v2([t]) != {"mamba": [True]}:
                return False
            got_t, got_c = self._host_state(c, load_slot)
            return bool(torch.equal(got_t, temporal) and torch.equal(got_c, conv))

        out: dict[str, Any] = {"errors": []}

        def run(op: Any) -> None:
            try:
                out[op.__name__] = sum(1 for i in range(rounds) if op(i))
            except Exception as exc:
                out["errors"].append(f"{op.__name__}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=run, args=(op,)) for op in (exists, store, load)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        c["group"].free(torch.tensor([store_slot, load_slot]), pool="mamba")
        return out

    def attach_order(self, name: str) -> dict[str, Any]:
        """A fresh backend over controller `name`'s pools (its own backend closed first),
        called in the order SGLang's controller calls it, the data path tried at each step:
        before `on_host_pools_registered` (SGLang's storage threads already run then), after
        it, after a side pool registered again at run time, after close()."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        from hicache.integrations.sglang import HicacheStorage

        torch = self.torch
        c = self.controllers.pop(name)
        c["backend"].close()
        backend = HicacheStorage(c["ctl"].storage_config)
        keys = [f"{i:064x}" for i in range(2)]
        kv_slots = torch.arange(2 * P)
        state = PoolTransfer(
            name=PoolName.MAMBA,
            keys=keys[-1:],
            host_indices=torch.tensor([0]),
            hit_policy=PoolHitPolicy.TRAILING_PAGES,
        )

        def exists_v2() -> list[Any]:
            exists = backend.batch_exists_v2(keys, [state])
            return [exists.kv_hit_pages, exists.restorable_prefix_pages]

        def calls() -> dict[str, Any]:  # in this order: stores first
            return {
                "set": backend.batch_set_v1(keys, kv_slots),
                "get": backend.batch_get_v1(keys, kv_slots),
                "exists": backend.batch_exists(keys),
                "set_v2": backend.batch_set_v2([state]),
                "get_v2": backend.batch_get_v2([state]),
                "exists_v2": exists_v2(),
                "connects": backend.link.counters.connects,
                "outages": backend.link.counters.outages,
            }

        out: dict[str, Any] = {}
        backend.register_mem_pool_host(c["kv_host"])
        out["kv_registered"] = calls()
        backend.register_mem_host_pool_v2(c["mamba_host"], PoolName.MAMBA)
        out["mamba_registered"] = calls()
        backend.on_host_pools_registered()
        out["ready"] = calls()
        region = backend.attached.region
        backend.register_mem_host_pool_v2(c["mamba_host"], PoolName.MAMBA)  # at run time
        out["registered_again"] = calls() | {
            "same_memfd": backend.attached.region is region,
            "side_pools": backend.side_pools,
        }
        backend.close()
        out["closed"] = calls()
        return out

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
