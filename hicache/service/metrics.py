"""Prometheus metrics of one sidecar, on a registry of its own (two services in one process —
the tests — never collide).

Counters and histograms that events feed (requests, errors, hit tokens, bytes and seconds per
transfer, evictions, the engines' per-layer stall) are updated where the event happens, once
per op, never per page. Gauges of state (queue depth, bytes in flight, host pool usage, pinned
bytes, L3 breaker state and failures) are read from stats snapshots at scrape time by
`StateCollector`, so the hot path pays nothing for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hicache.storage import GuardedStore
from hicache.storage.breaker import BreakerState

if TYPE_CHECKING:
    from hicache.cache import TieredCache
    from hicache.service.namespaces import Namespace

_BYTES_BUCKETS = tuple(float(2**i) for i in range(12, 34, 2))  # 4 KiB .. 8 GiB
_SECONDS_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
_BREAKER = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # process_resident_memory_bytes, cpu seconds, open fds: what shows a leak or growth
        ProcessCollector(registry=r)
        self.requests = Histogram(
            "hicache_request_seconds",
            "Engine-channel request handling time, by op",
            ["op"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "hicache_request_errors", "Error replies, by error code", ["code"], registry=r
        )
        self.sessions = Gauge("hicache_sessions", "Engine sessions attached", registry=r)
        # the KV-event publisher's counts (`KvEvents.counts`), read at scrape time; none: off
        self.kv_events: Callable[[], dict[str, int]] = dict
        # lookups are the most frequent request: plain ints here, exported at scrape time
        self.hit_tokens = {"l2": 0, "l3": 0, "miss": 0}
        self.hit_pages = {"l2": 0, "l3": 0, "miss": 0}
        # the same tokens per tenant (of a namespace; a session with none is not counted)
        self.tenant_hit_tokens: dict[str, dict[str, int]] = {}
        self.transfer_bytes = Histogram(
            "hicache_transfer_bytes",
            "Bytes moved per op, by direction (load: L2 to L1, backup: L1 to L2)",
            ["direction"],
            buckets=_BYTES_BUCKETS,
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "hicache_transfer_seconds",
            "Time per op from start to done, by direction",
            ["direction"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.layer_stall = Histogram(
            "hicache_layer_stall_seconds",
            "Time an engine's wait_layer blocked, per layer (reported by engines)",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.evictions = Counter(
            "hicache_l2_evictions", "Host (L2) pages evicted to make room", registry=r
        )
        self.connections_dropped = Counter(
            "hicache_connections_dropped",
            "Engine connections the sidecar closed, by reason (slow_reader: replies unread "
            "past service.slow_reader_timeout_s; oversized_frame: over service.max_frame_bytes)",
            ["reason"],
            registry=r,
        )
        self.loads_starved = Counter(
            "hicache_engine_loads_starved",
            "Loads engines recomputed for want of free pages in their own staging pool "
            "(reported by engines with heartbeats; raise their staging size)",
            registry=r,
        )
        self.loads_starved_count = 0  # the same, for /v1/stats
        self.store_waits = Counter(
            "hicache_lookup_store_waits",
            "Key lookups that waited for pages a store in flight was writing (wait_stored_s, "
            "a decode instance's), by how the wait ended: hit, missed, timed_out, drained",
            ["outcome"],
            registry=r,
        )
        self.page_size_tokens = 1
        self._requests: dict[str, Any] = {}  # children bound once (labels() takes a lock)

    def starved(self, loads: int) -> None:
        if loads:
            self.loads_starved.inc(loads)
            self.loads_starved_count += loads

    def request(self, op: str, seconds: float) -> None:
        child = self._requests.get(op)
        if child is None:
            child = self._requests[op] = self.requests.labels(op)
        child.observe(seconds)

    def lookup(
        self, tokens_l2: int, tokens_total: int, tokens_asked: int, tenant: str | None = None
    ) -> None:
        page = self.page_size_tokens
        tokens, pages = self.hit_tokens, self.hit_pages
        tokens["l2"] += tokens_l2
        tokens["l3"] += tokens_total - tokens_l2
        tokens["miss"] += tokens_asked - tokens_total
        if tenant is not None:
            mine = self.tenant_hit_tokens.get(tenant)
            if mine is None:
                mine = self.tenant_hit_tokens[tenant] = {"l2": 0, "l3": 0, "miss": 0}
            mine["l2"] += tokens_l2
            mine["l3"] += tokens_total - tokens_l2
            mine["miss"] += tokens_asked - tokens_total
        pages["l2"] += tokens_l2 // page
        pages["l3"] += (tokens_total - tokens_l2) // page
        pages["miss"] += tokens_asked // page - tokens_total // page

    def moved(self, direction: str, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.labels(direction).observe(nbytes)
        self.transfer_seconds.labels(direction).observe(seconds)

    def watch(
        self,
        namespaces: Callable[[], Iterable[Namespace]],
        store: Callable[[], GuardedStore | None],
    ) -> None:
        self.registry.register(StateCollector(namespaces, store, self))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class StateCollector(Collector):
    def __init__(
        self,
        namespaces: Callable[[], Iterable[Namespace]],
        store: Callable[[], GuardedStore | None],
        metrics: ServiceMetrics,
    ):
        self._namespaces = namespaces
        self._store = store
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        tokens = CounterMetricFamily(
            "hicache_lookup_tokens",
            "Prompt tokens looked up, by the tier that can serve them (hybrid-aware: a token "
            "counts as a hit only when every cache group can serve it)",
            labels=["tier"],
        )
        pages = CounterMetricFamily(
            "hicache_lookup_pages",
            "Prompt pages (keys) looked up, by the tier that can serve them",
            labels=["tier"],
        )
        for tier, count in self._metrics.hit_tokens.items():
            tokens.add_metric([tier], count)
        for tier, count in self._metrics.hit_pages.items():
            pages.add_metric([tier], count)
        yield tokens
        yield pages
        queue = GaugeMetricFamily(
            "hicache_queue_depth", "Ops queued, by kind (load, backup)", labels=["kind"]
        )
        inflight = GaugeMetricFamily("hicache_inflight_bytes", "Bytes of walks in flight")
        used = GaugeMetricFamily(
            "hicache_host_pool_used_bytes",
            "Host (L2) bytes holding pages, by cache group",
            labels=["group"],
        )
        capacity = GaugeMetricFamily(
            "hicache_host_pool_capacity_bytes",
            "Host (L2) pool size, by cache group",
            labels=["group"],
        )
        pinned = GaugeMetricFamily(
            "hicache_host_pool_pinned_bytes",
            "Host (L2) bytes pinned by loads in flight, by cache group",
            labels=["group"],
        )
        l3_only = GaugeMetricFamily(
            "hicache_index_l3_only_pages",
            "Pages only L3 holds that the index remembers, by cache group (bounded by "
            "cache.l3_index_max_pages)",
            labels=["group"],
        )
        forgotten = CounterMetricFamily(
            "hicache_index_l3_forgotten_pages",
            "L3-only pages the index forgot to stay within its bound, by cache group (found "
            "again by asking L3 at lookup)",
            labels=["group"],
        )
        absent_skipped = CounterMetricFamily(
            "hicache_l3_absent_skipped_keys",
            "Page keys a lookup did not ask L3 about because L3 had just said it lacks them "
            "(cache.l3_absent_ttl_s)",
        )
        # each per-group family with how one namespace's cache adds to it (summed over them)
        per_group: list[
            tuple[GaugeMetricFamily | CounterMetricFamily, Callable[[TieredCache, str], int]]
        ] = [
            (used, lambda c, g: c.index.l2_pages(g) * _page_bytes(c, g)),
            (pinned, lambda c, g: c.index.pinned_pages(g) * _page_bytes(c, g)),
            (l3_only, lambda c, g: c.index.l3_only_pages(g)),
            (forgotten, lambda c, g: c.index.l3_forgotten[g]),
        ]
        sums: list[dict[str, int]] = [{} for _ in per_group]
        capacities: dict[int, dict[str, int]] = {}  # per L2: a rank's shared one counted once
        skipped_total = q_load = q_backup = inflight_bytes = 0
        for namespace in self._namespaces():
            cache = namespace.cache
            capacities[namespace.l2_identity] = {
                g: cache.host_pool_stats(g).capacity_bytes for g in cache.index.rules
            }
            stats = cache.scheduler_stats()
            q_load += stats.queued_loads
            q_backup += stats.queued_backups
            inflight_bytes += stats.in_flight_bytes
            skipped_total += cache.discovery.absent.skipped
            for group in cache.index.rules:
                for (_, value), acc in zip(per_group, sums, strict=True):
                    acc[group] = acc.get(group, 0) + value(cache, group)
        queue.add_metric(["load"], q_load)
        queue.add_metric(["backup"], q_backup)
        inflight.add_metric([], inflight_bytes)
        for (family, _), acc in zip(per_group, sums, strict=True):
            for group, total in acc.items():
                family.add_metric([group], total)
        per_group_capacity: dict[str, int] = {}
        for pools in capacities.values():
            for group, nbytes in pools.items():
                per_group_capacity[group] = per_group_capacity.get(group, 0) + nbytes
        for group, total in per_group_capacity.items():
            capacity.add_metric([group], total)
        absent_skipped.add_metric([], skipped_total)
        families = [family for family, _ in per_group]  # used first, as before
        yield from (queue, inflight, families[0], capacity, *families[1:], absent_skipped)
        yield from self._tenants()
        store = self._store()
        breaker = GaugeMetricFamily(
            "hicache_l3_breaker_state",
            "L3 circuit breaker: 0 closed, 1 half-open, 2 open (no sample without L3)",
        )
        failures = CounterMetricFamily(
            "hicache_l3_failures",
            "L3 calls failed, by reason (op:error; each becomes misses, never an engine error)",
            labels=["reason"],
        )
        l3 = CounterMetricFamily(
            "hicache_l3_objects",
            "L3 objects by outcome (stored, hit, miss, corrupt_dropped: failed their header "
            "or checksum, damaged: not an object at all — a directory, FIFO, link or wrong "
            "type in its place —, skipped_open)",
            labels=["outcome"],
        )
        l3_bytes = CounterMetricFamily(
            "hicache_l3_bytes", "L3 payload bytes, by direction (put, get)", labels=["direction"]
        )
        l3_seconds = CounterMetricFamily(
            "hicache_l3_seconds", "Time in L3 calls, by direction (put, get)", labels=["direction"]
        )
        if store is not None:  # without L3 the families are exported empty
            breaker.add_metric([], _BREAKER[store.breaker.state])
            for reason, count in store.stats.failures.items():
                failures.add_metric([reason], count)
            s = store.stats
            for outcome, count in (
                ("stored", s.stored),
                ("hit", s.hits),
                ("miss", s.misses),
                ("corrupt_dropped", s.corrupt_dropped),
                ("damaged", store.objects_damaged),
                ("skipped_open", s.skipped_open),
            ):
                l3.add_metric([outcome], count)
            l3_bytes.add_metric(["put"], s.put_bytes)
            l3_bytes.add_metric(["get"], s.get_bytes)
            l3_seconds.add_metric(["put"], s.put_seconds)
            l3_seconds.add_metric(["get"], s.get_seconds)
        yield from (breaker, failures, l3, l3_bytes, l3_seconds)
        yield from self._kv_events()

    def _kv_events(self) -> Iterator[Metric]:
        counts = self._metrics.kv_events()
        events = CounterMetricFamily(
            "hicache_kv_events",
            "KV events for routers (service.kv_events), by outcome: sent, or dropped (the "
            "publisher's queue full or the socket refusing the send; empty when off)",
            labels=["outcome"],
        )
        batches = CounterMetricFamily(
            "hicache_kv_event_batches",
            "KV event batches (one ZMQ message each), by outcome: sent, dropped",
            labels=["outcome"],
        )
        for outcome in ("sent", "dropped"):
            if f"events_{outcome}" in counts:
                events.add_metric([outcome], counts[f"events_{outcome}"])
                batches.add_metric([outcome], counts[f"batches_{outcome}"])
        yield from (events, batches)

    def _tenants(self) -> Iterator[Metric]:
        """Per-tenant families: lookup tokens by tier, and (tenants sharing L2) pages held,
        guaranteed and evicted, summed over tensor-parallel ranks."""
        lookups = CounterMetricFamily(
            "hicache_tenant_lookup_tokens",
            "Prompt tokens a tenant's lookups asked, by the tier that can serve them",
            labels=["tenant", "tier"],
        )
        for tenant, tiers in sorted(self._metrics.tenant_hit_tokens.items()):
            for tier, count in tiers.items():
                lookups.add_metric([tenant, tier], count)
        held = GaugeMetricFamily(
            "hicache_tenant_l2_pages",
            "L2 pages a tenant holds on an L2 shared by tenants (tenants.shared_l2), by group",
            labels=["tenant", "group"],
        )
        share = GaugeMetricFamily(
            "hicache_tenant_l2_share_pages",
            "L2 pages guaranteed to a tenant's holder (itself when listed in "
            "tenants.l2_shares, else the unlisted tenants together), by group",
            labels=["tenant", "group"],
        )
        evicted = CounterMetricFamily(
            "hicache_tenant_l2_evicted_pages",
            "A tenant's L2 pages evicted, by group and for whom (self: its own stores and "
            "fetches; other: another tenant's)",
            labels=["tenant", "group", "by"],
        )
        sums: dict[tuple[str, str], list[int]] = {}
        for namespace in self._namespaces():
            shares = namespace.cache.planner.shares
            if shares is None:
                continue
            tenant = namespace.key.tenant
            for group, s in shares.stats()[tenant].items():
                acc = sums.setdefault((tenant, group), [0, 0, 0, 0])
                acc[0] += s.held_pages
                acc[1] += s.share_pages
                acc[2] += s.evicted_pages - s.evicted_by_others_pages
                acc[3] += s.evicted_by_others_pages
        for (tenant, group), (pages, guaranteed, by_self, by_other) in sorted(sums.items()):
            held.add_metric([tenant, group], pages)
            share.add_metric([tenant, group], guaranteed)
            evicted.add_metric([tenant, group, "self"], by_self)
            evicted.add_metric([tenant, group, "other"], by_other)
        yield from (lookups, held, share, evicted)


def _page_bytes(cache: TieredCache, group: str) -> int:
    return cache.host_pool_stats(group).page_bytes


def metrics_reference() -> str:
    """The metrics table of docs/reference.md: every family a sidecar exports, its type, help."""
    metrics = ServiceMetrics()
    metrics.watch(list, lambda: None)
    rows = ["| metric | type | meaning |", "|---|---|---|"]
    for family in metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        rows.append(f"| `{name}` | {family.type} | {family.documentation} |")
    return "\n".join(rows) + "\n"
