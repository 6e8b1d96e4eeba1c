"""JSON snapshots of a namespace, of the tenants and of the L3 store: the `stats` op and
`/v1/stats` answer with these."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any

from hicache.cache.writing import pending_pages
from hicache.service.namespaces import Namespace
from hicache.storage import GuardedStore


def namespace_stats(namespace: Namespace) -> dict[str, Any]:
    cache = namespace.cache
    sched = cache.scheduler_stats()
    groups = {}
    for group, rule in cache.index.rules.items():
        pool = cache.host_pool_stats(group)
        token_group = rule.kind.is_token_cache
        groups[group] = {
            "l2_pages": cache.index.l2_pages(group),
            "l2_capacity_pages": pool.num_pages,
            # what a page is: page_size tokens of KV, or one state snapshot
            "l2_budget": (
                {"tokens": pool.num_pages * cache.index.page_size_tokens}
                if token_group
                else {"snapshots": pool.num_pages}
            ),
            "l2_bytes": pool.capacity_bytes,
            "pinned_pages": cache.index.pinned_pages(group),
            # host pages a copy still reads or writes, and pages allocated to an op in
            # flight but not indexed: both 0 once every op has ended (nothing leaked)
            "host_pinned_pages": pool.pinned_pages,
            "reserved_pages": pool.num_pages - pool.free_pages - cache.index.l2_pages(group),
            "l3_pages_known": cache.index.l3_pages(group),
            "l3_only_pages": cache.index.l3_only_pages(group),
            "l3_pages_forgotten": cache.index.l3_forgotten[group],
        }
    return {
        "namespace": str(namespace.key),
        "l3_absent_remembered": len(cache.discovery.absent),
        "l3_absent_skipped_keys": cache.discovery.absent.skipped,
        "l3_absent_asked_again_keys": cache.discovery.absent.asked_again,
        "attached_sessions": sorted(namespace.attached),
        # device-pool sets the scheduler holds (one per attached engine session)
        "attachments": cache.attachments,
        "groups": groups,
        "queued_loads": sched.queued_loads,
        "queued_backups": sched.queued_backups,
        "in_flight_bytes": sched.in_flight_bytes,
        "in_flight_walks": sched.in_flight_walks,
        "ops_by_state": dict(sched.ops_by_state),
        # pages store plans in flight are writing (not in L2 yet; a lookup may wait for them)
        "stores_writing_pages": pending_pages(cache.planner),
        "persist": asdict(cache.persist.stats()),
        # pages of replicated groups (MLA latents) this tensor-parallel rank left to rank 0
        "l3_replica_skipped_pages": cache.io.replica_skipped_pages,
        "l3_resync": asdict(cache.resync.stats()),
        "background_errors": cache.background_errors,
        "load": asdict(sched.load),
        "backup": asdict(sched.backup),
    }


def tenant_stats(
    namespaces: Iterable[Namespace], hit_tokens: Mapping[str, Mapping[str, int]]
) -> dict[str, Any]:
    """Per tenant: the prompt tokens its lookups asked, by the tier that could serve them
    (`l2`, `l3`, `miss`), and, when tenants share L2 (`tenants.shared_l2`), per tp_rank and
    group: the pages it holds, its guaranteed share and cap in pages (of its holder: itself
    when listed, else every unlisted tenant together, `*`), its pages evicted and, of
    those, evicted to make room for another tenant."""
    out: dict[str, Any] = {}
    for namespace in namespaces:
        tenant = namespace.key.tenant
        entry = out.setdefault(tenant, {"lookup_tokens": {"l2": 0, "l3": 0, "miss": 0}})
        shares = namespace.cache.planner.shares
        if shares is None:
            continue
        entry["holder"] = shares.holder(tenant)
        entry.setdefault("l2", {})[str(namespace.key.tp_rank)] = {
            group: asdict(stats) for group, stats in shares.stats()[tenant].items()
        }
    for tenant, hits in hit_tokens.items():
        entry = out.setdefault(tenant, {})
        entry["lookup_tokens"] = dict(hits)
    return dict(sorted(out.items()))


def store_stats(store: GuardedStore | None) -> dict[str, Any] | None:
    if store is None:
        return None
    s = store.stats
    return {
        "breaker": store.breaker.state.value,
        "puts": s.puts,
        "stored": s.stored,
        "gets": s.gets,
        "hits": s.hits,
        "misses": s.misses,
        "corrupt_dropped": s.corrupt_dropped,
        "objects_damaged": store.objects_damaged,
        "skipped_open": s.skipped_open,
        "put_bytes": s.put_bytes,
        "put_seconds": s.put_seconds,
        "get_bytes": s.get_bytes,
        "get_seconds": s.get_seconds,
        "failures": dict(s.failures),
    }
