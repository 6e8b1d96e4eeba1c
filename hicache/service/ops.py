"""`EngineOps`: the engine channel's ops — hello, pool registration, lookup (by tokens, by page
keys, several in one frame), store, load, prefetch, release, stats, heartbeat — each checking
its session and arguments and naming what is wrong. `EngineServer` (server.py) owns the state
they use and dispatches to them.

A lookup by keys (`lookup_keys`, `lookup_many`) is the token lookup without decoding,
validating and hashing a token list: the blobs are checked (whole keys, the same count in
every cached group, at most `MAX_TOKENS` tokens' worth, `num_tokens` consistent with them),
looked up as they are, and the reply is the token lookup's, discovery (asking L3 about pages
the index does not know) included."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from hicache.assembly import ServiceSettings
from hicache.assembly.sidecar import SidecarPlan
from hicache.cache.keyers import page_keyers
from hicache.channel import protocol as p
from hicache.channel.counters import CounterFile, LoadState
from hicache.channel.shm import map_pools
from hicache.errors import HicacheError
from hicache.index import KEY_BYTES, Hit, PackedKeys
from hicache.memory import DevicePool, GroupGeometry
from hicache.model import LayerMap
from hicache.scheduler import OpResult, OpState
from hicache.service.metrics import ServiceMetrics
from hicache.service.namespaces import Namespace, NamespaceKey
from hicache.service.sessions import LoadEntry, Session, same_process
from hicache.service.snapshots import namespace_stats, store_stats
from hicache.storage import GuardedStore
from hicache.transfer import NO_FENCE, CopyBackend, Fence, LayerFailure

log = logging.getLogger("hicache.service")

_FINAL = {
    OpState.DONE: LoadState.DONE,
    OpState.FAILED: LoadState.FAILED,
    OpState.CANCELLED: LoadState.CANCELLED,
    OpState.EXPIRED: LoadState.FAILED,
}


class DeferToAwait(Exception):
    """An inline handler found it must await after all (a lookup that L3 may extend)."""


class EngineOps:
    # set by EngineServer.__init__
    plan: SidecarPlan
    service: ServiceSettings
    layer_map: LayerMap
    model_name: str
    backend: CopyBackend
    store: GuardedStore | None
    metrics: ServiceMetrics
    geometries: dict[str, GroupGeometry]
    layout: dict[str, Any]
    namespaces: dict[NamespaceKey, Namespace]
    key_groups: tuple[str, ...]  # the groups the cache keys (the move policy may drop some)
    sessions: dict[int, Session]
    _tg: asyncio.TaskGroup
    _load_ids: itertools.count[int]

    async def _hello(self, session: Session, args: p.Hello) -> dict[str, Any]:
        if session.key is not None:
            raise p.RequestError(p.ErrorCode.REFUSED, "hello: this session already said hello")
        if args.protocol != p.PROTOCOL_VERSION:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"hello.protocol: engine speaks version {args.protocol}; this sidecar speaks "
                f"{p.PROTOCOL_VERSION}",
            )
        secret = self.service.token
        if secret is not None and not hmac.compare_digest(
            (args.token or "").encode(), secret.get_secret_value().encode()
        ):
            raise p.RequestError(
                p.ErrorCode.REFUSED, "hello.token: missing or wrong (service.token is set)"
            )
        self._check_tp(args)
        diffs = p.layout_differences(args.layout, self.layout)
        if diffs:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                "hello.layout: the engine's KV layout differs from the sidecar's model; "
                + "; ".join(diffs),
            )
        # any number of engine sessions share a namespace (replicas of one model side by
        # side): each registers its own pools; the index, L2 and L3 are the namespace's
        key = NamespaceKey(args.tp_rank, args.tenant)
        session.key, session.engine, session.pid = key, args.engine, args.pid
        session.lookup_only = args.role == "lookup"
        log.info(
            "session started",
            extra={
                "fields": {
                    "session": session.id,
                    "pid": session.peer_pid or args.pid or None,
                    "tp_rank": args.tp_rank,
                    "tenant": args.tenant,
                    "role": args.role,
                    "engine": args.engine or None,
                    "transport": "unix" if session.unix else "tcp",
                }
            },
        )
        return {
            "session": session.id,
            "protocol": p.PROTOCOL_VERSION,
            "heartbeat_timeout_s": self.service.heartbeat_timeout_s,
            "load_slots": self.service.load_slots,
            "keys": self._key_spec(key),
            "tp_size": self.layer_map.layout.tp_size,
            # stored once in L3 (by rank 0) and served to every rank (none at tp_size 1)
            "replicated_groups": [
                g.name
                for g in self.layer_map.groups
                if g.replicated and self.layer_map.layout.tp_size > 1
            ],
        }

    def _check_tp(self, args: p.Hello) -> None:
        """The engine's tensor-parallel size is the deployment's, its rank one of them."""
        ours = self.plan.tp_size
        if args.tp_size != ours:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"hello.tp_size: the engine runs tensor-parallel size {args.tp_size}; this "
                f"sidecar serves model.tp_size = {ours} (each rank's share of the KV heads "
                "differs by size); allowed: the same tp_size on both sides",
            )
        if args.tp_size > 1 and args.tp_rank >= args.tp_size:  # tp_size 1: see check_tp_rank
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"hello.tp_rank: {args.tp_rank} is not a rank of tp_size {args.tp_size} "
                f"(model.tp_size = {ours}); allowed: 0..{args.tp_size - 1}",
            )

    def _key_spec(self, key: NamespaceKey) -> dict[str, Any]:
        """What an engine needs to compute its namespace's page keys itself (`lookup_keys`):
        each cached group's keyer root, the page size, the algorithm."""
        namespace = self.namespaces.get(key)
        if namespace is not None:
            roots = namespace.cache.key_roots()
        else:  # no cache yet: the keyers it will have (Namespace.start builds them alike)
            keyers = page_keyers(
                self.geometries,
                self.layer_map,
                self.plan.move_policy,
                model=self.model_name,
                tenant_salt=self.plan.key_salt(key.tenant),
                tp_rank=key.tp_rank,
                key_algorithm=self.plan.key_algorithm,
            )
            roots = {group: keyer.root for group, keyer in keyers.items()}
        return {
            "algorithm": self.plan.key_algorithm,
            "page_size_tokens": self.plan.page_size_tokens,
            "roots": roots,
        }

    async def _register_pools(self, session: Session, args: p.RegisterPools) -> dict[str, Any]:
        """The CPU data plane: the engine's pool is a sealed memfd of its own we map."""
        if self.plan.device_kind != "cpu":
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                "register_pools: this sidecar copies on CUDA (device.kind: cuda); export the "
                "engine's CUDA pools with register_cuda_pools",
            )
        self._check_unregistered(session, "register_pools")
        pid = self._peer_pid(session, "register_pools")
        try:
            pools, identity = map_pools(
                args.model_dump(), self.geometries, pid, self._alive(session)
            )
        except HicacheError as exc:
            raise p.RequestError(p.ErrorCode.BAD_REQUEST, f"register_pools.{exc}") from None
        return await self._attach(
            session, pools, pid, args.counters_fd, "register_pools", [identity]
        )

    @staticmethod
    def _alive(session: Session) -> Callable[[], bool]:
        assert session.peer_pid is not None
        pid, start = session.peer_pid, session.peer_start
        return lambda: same_process(pid, start)

    def _peer_pid(self, session: Session, op: str) -> int:
        """The engine process as the kernel names it: shared memory is only ever taken from
        the process on the other end of this session's Unix socket."""
        if not session.unix:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"{op}: this session came over TCP; shared memory is registered only over the "
                f"Unix socket ({self.service.socket_path}), whose peer the kernel names, so "
                "that no session can register another process's memory",
            )
        if session.peer_pid is None:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"{op}: the engine is outside the sidecar's pid namespace (the kernel names "
                "its pid 0), so its memory cannot be taken from it; run it in the sidecar's "
                'pid namespace (compose: pid: "service:<sidecar>"; docker: --pid '
                "container:<sidecar>)",
            )
        if not same_process(session.peer_pid, session.peer_start):
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"{op}: the process that connected (pid {session.peer_pid}) has exited; its "
                "pid may be another's now: connect from the process that holds the pool",
            )
        return session.peer_pid

    async def _register_cuda_pools(
        self, session: Session, args: p.RegisterCudaPools
    ) -> dict[str, Any]:
        """The CUDA data plane: the engine's pool tensors arrive as CUDA IPC handles."""
        if self.plan.device_kind != "cuda":
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                "register_cuda_pools: this sidecar copies on CPU (device.kind: cpu); share the "
                "pool through shared memory with register_pools, or run the sidecar with "
                "device.kind: cuda",
            )
        self._check_unregistered(session, "register_cuda_pools")
        from hicache.transfer.cuda_ipc import map_cuda_pools  # CUDA only when used

        pid = self._peer_pid(session, "register_cuda_pools")
        try:
            pools = map_cuda_pools(args.model_dump(), self.geometries)
        except HicacheError as exc:
            raise p.RequestError(p.ErrorCode.BAD_REQUEST, f"register_cuda_pools.{exc}") from None
        return await self._attach(session, pools, pid, args.counters_fd, "register_cuda_pools", [])

    def _check_unregistered(self, session: Session, op: str) -> None:
        if session.lookup_only:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"{op}: this session said hello with role 'lookup'; only an 'engine' session "
                "registers pools, stores and loads",
            )
        if session.pools is not None:
            raise p.RequestError(p.ErrorCode.REFUSED, f"{op}: pools already registered")

    async def _attach(
        self,
        session: Session,
        pools: dict[str, DevicePool],
        pid: int,
        counters_fd: int,
        op: str,
        memory: list[tuple[int, int]],
    ) -> dict[str, Any]:
        assert session.key is not None
        try:
            counters, identity = CounterFile.of_peer(
                pid, counters_fd, self.service.load_slots, self._alive(session)
            )
        except HicacheError as exc:
            raise p.RequestError(p.ErrorCode.BAD_REQUEST, f"{op}.{exc}") from None
        memory = [*memory, identity]
        if len(set(memory)) < len(memory):
            raise p.RequestError(
                p.ErrorCode.BAD_REQUEST,
                f"{op}.counters_fd: the counters are the pool's own memory; give each its memfd",
            )
        for other in self.sessions.values():
            shared = set(memory) & set(other.memory)
            same = (other.peer_pid, other.peer_start) == (pid, session.peer_start)
            if other is not session and not same and shared:
                # another process's memfd reached through a descriptor of this one (opened
                # from /proc): the sidecar would move this session's bytes into its memory
                raise p.RequestError(
                    p.ErrorCode.REFUSED,
                    f"{op}: this memory is registered by {other.describe()}; a session "
                    "registers memfds its own process created",
                )
        session.memory = memory  # claimed before the await: a racing claim sees it
        namespace = self.namespaces.get(session.key)
        try:
            if namespace is None:
                namespace = await Namespace.start(
                    session.key,
                    self.plan,
                    self.backend,
                    self.store,
                    pools,
                    self._tg,
                )
                self.namespaces[session.key] = namespace
            namespace.attach(session.id, pools)
        except BaseException:
            session.memory = []
            raise
        session.namespace, session.pools, session.counters = namespace, pools, counters
        session.free_slots = list(range(self.service.load_slots - 1, -1, -1))
        return {"slots": counters.slots}

    def _ready(self, session: Session, op: str) -> Namespace:
        if session.lookup_only:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"{op}: this session said hello with role 'lookup'; it may only lookup, "
                "prefetch and ask stats",
            )
        if session.namespace is None:
            raise p.RequestError(p.ErrorCode.NOT_READY, f"{op}: send register_pools first")
        return session.namespace

    def _readable(self, session: Session, op: str) -> Namespace | None:
        """The namespace a lookup reads: an engine session's own, or for a 'lookup' session
        its namespace while a session of its own engine (same `engine` name in hello) is
        attached there: None while none is, so a scheduler never promises hits only another
        engine could load."""
        if session.lookup_only:
            if session.key is None:
                raise p.RequestError(p.ErrorCode.NOT_READY, f"{op}: send hello first")
            namespace = self.namespaces.get(session.key)
            if namespace is None or not any(
                (worker := self.sessions.get(sid)) is not None and worker.engine == session.engine
                for sid in namespace.attached
            ):
                # no worker of *this* engine is attached: its hits could not be loaded
                # (only other engines' workers are, or none is)
                return None
            return namespace
        return self._ready(session, op)

    def _check_pages(
        self,
        session: Session,
        op: str,
        device_pages: Mapping[str, Sequence[int | None]],
        snapshots: Mapping[str, Sequence[Sequence[int]]] | None = None,
    ) -> None:
        """Every page named is inside the engine's registered pool; a load names every group,
        a store every token group (its state groups' snapshots come in `snapshots`)."""
        assert session.pools is not None
        named = dict(device_pages)
        for group, pairs in (snapshots or {}).items():
            self._check_in_pool(session, f"{op}.snapshots", group, [slot for _, slot in pairs])
        for group, pages in named.items():
            self._check_in_pool(session, f"{op}.device_pages", group, pages)
        required = set(session.pools)
        if snapshots is not None:
            required = {g for g in required if self.layer_map.group(g).kind.is_token_cache}
        missing = required - set(named)
        if missing:
            raise p.RequestError(
                p.ErrorCode.BAD_REQUEST,
                f"{op}.device_pages: groups {sorted(missing)} missing; every "
                f"{'token ' if snapshots is not None else ''}group of the layout needs its pages",
            )

    def _check_in_pool(
        self, session: Session, where: str, group: str, pages: Sequence[int | None]
    ) -> None:
        assert session.pools is not None
        pool = session.pools.get(group)
        if pool is None:
            raise p.RequestError(
                p.ErrorCode.BAD_REQUEST,
                f"{where}: group {group!r} is not in the layout; groups: "
                f"{', '.join(sorted(session.pools))}",
            )
        bad = [page for page in pages if page is not None and page >= pool.num_pages]
        if bad:
            raise p.RequestError(
                p.ErrorCode.OUT_OF_RANGE,
                f"{where}.{group}: pages {bad[:5]} are outside the registered "
                f"pool of {pool.num_pages} pages (0..{pool.num_pages - 1})",
            )

    def _lookup(self, session: Session, args: p.Tokens) -> dict[str, Any]:
        namespace = self._readable(session, "lookup")
        if namespace is None:
            return self._lookup_reply(
                Hit(self.plan.page_size_tokens, 0, 0, {}, {}), len(args.tokens)
            )
        cache = namespace.cache
        hit = cache.lookup(args.tokens)
        if cache.needs_discovery(args.tokens, hit):
            raise DeferToAwait  # ask L3 first: the async path (`_lookup_discovering`)
        return self._lookup_reply(hit, len(args.tokens))

    async def _lookup_discovering(self, session: Session, args: p.Tokens) -> dict[str, Any]:
        namespace = self._readable(session, "lookup")
        if namespace is None:
            return self._lookup_reply(
                Hit(self.plan.page_size_tokens, 0, 0, {}, {}), len(args.tokens)
            )
        cache = namespace.cache
        await cache.discover(args.tokens)
        return self._lookup_reply(cache.lookup(args.tokens), len(args.tokens))

    def _packed_keys(self, args: p.KeyLookup, where: str) -> tuple[dict[str, PackedKeys], int]:
        """A key lookup's blobs, checked: every cached group, whole keys, the same count in
        each, at most MAX_TOKENS tokens' worth; and the prompt's length they imply."""
        page = self.plan.page_size_tokens
        missing = sorted(set(self.key_groups) - set(args.keys))
        unknown = sorted(set(args.keys) - set(self.key_groups))
        if missing or unknown:
            what = "; ".join(
                part
                for part in (
                    f"groups {missing} missing" if missing else "",
                    f"groups {unknown} are not cached here" if unknown else "",
                )
                if part
            )
            raise p.RequestError(
                p.ErrorCode.BAD_REQUEST,
                f"{where}.keys: {what}; give the keys of exactly {list(self.key_groups)} "
                "(hello's keys.roots names them)",
            )
        counts = {}
        for group, blob in args.keys.items():
            count, rest = divmod(len(blob), KEY_BYTES)
            if rest:
                raise p.RequestError(
                    p.ErrorCode.BAD_REQUEST,
                    f"{where}.keys.{group}: the engine sent {len(blob)} bytes, not a whole number "
                    f"of {KEY_BYTES}-byte page keys; send the group's keys concatenated",
                )
            if count * page > p.MAX_TOKENS:
                raise p.RequestError(
                    p.ErrorCode.BAD_REQUEST,
                    f"{where}.keys.{group}: the engine sent {count} keys, {count * page} tokens "
                    f"at {page} tokens per page; a lookup covers at most {p.MAX_TOKENS} tokens "
                    f"({p.MAX_TOKENS // page} keys)",
                )
            counts[group] = count
        pages = min(counts.values(), default=0)
        if any(count != pages for count in counts.values()):
            raise p.RequestError(
                p.ErrorCode.BAD_REQUEST,
                f"{where}.keys: the engine sent {counts} keys per group; a prompt has one key "
                "per full page in every group",
            )
        asked = pages * page if args.num_tokens is None else args.num_tokens
        if asked // page != pages:
            raise p.RequestError(
                p.ErrorCode.BAD_REQUEST,
                f"{where}.num_tokens: {asked} tokens are {asked // page} full pages of {page} "
                f"tokens; the engine sent {pages} keys per group",
            )
        return {group: PackedKeys(blob) for group, blob in args.keys.items()}, asked

    def _lookup_keys(self, session: Session, args: p.KeyLookup) -> dict[str, Any]:
        return self._key_lookups(session, [args], "lookup_keys")[0]

    async def _lookup_keys_discovering(self, session: Session, args: p.KeyLookup) -> dict[str, Any]:
        return (await self._key_lookups_discovering(session, [args], "lookup_keys"))[0]

    def _lookup_many(self, session: Session, args: p.LookupMany) -> dict[str, Any]:
        return {"results": self._key_lookups(session, args.lookups, "lookup_many")}

    async def _lookup_many_discovering(
        self, session: Session, args: p.LookupMany
    ) -> dict[str, Any]:
        results = await self._key_lookups_discovering(session, args.lookups, "lookup_many")
        return {"results": results}

    def _checked_lookups(
        self, session: Session, lookups: Sequence[p.KeyLookup], op: str
    ) -> tuple[Namespace | None, list[tuple[dict[str, PackedKeys], int]]]:
        namespace = self._readable(session, op)
        many = op == "lookup_many"
        return namespace, [
            self._packed_keys(args, f"{op}.lookups.{i}" if many else op)
            for i, args in enumerate(lookups)
        ]

    def _key_lookups(
        self, session: Session, lookups: Sequence[p.KeyLookup], op: str
    ) -> list[dict[str, Any]]:
        """Inline: the hits, or DeferToAwait when L3 may extend any (then all go through
        `_key_lookups_discovering`; nothing was counted yet)."""
        namespace, checked = self._checked_lookups(session, lookups, op)
        if namespace is None:
            hits = [self._no_hit()] * len(checked)
        else:
            cache = namespace.cache
            hits = []
            for keys, _ in checked:
                hit = cache.lookup_keys(keys)
                if cache.needs_discovery_keys(keys, hit):
                    raise DeferToAwait  # ask L3 first
                hits.append(hit)
        return [
            self._lookup_reply(hit, asked) for hit, (_, asked) in zip(hits, checked, strict=True)
        ]

    async def _key_lookups_discovering(
        self, session: Session, lookups: Sequence[p.KeyLookup], op: str
    ) -> list[dict[str, Any]]:
        namespace, checked = self._checked_lookups(session, lookups, op)
        replies = []
        for keys, asked in checked:
            if namespace is None:
                hit = self._no_hit()
            else:
                cache = namespace.cache
                hit = cache.lookup_keys(keys)
                if cache.needs_discovery_keys(keys, hit):
                    await cache.discover_keys(keys)
                    hit = cache.lookup_keys(keys)
            replies.append(self._lookup_reply(hit, asked))
        return replies

    def _no_hit(self) -> Hit:
        return Hit(self.plan.page_size_tokens, 0, 0, {}, {})

    def _lookup_reply(self, hit: Hit, asked: int) -> dict[str, Any]:
        self.metrics.lookup(hit.tokens_l2, hit.tokens_total, asked)
        return {
            "page_size_tokens": hit.page_size_tokens,
            "tokens_l2": hit.tokens_l2,
            "tokens_total": hit.tokens_total,
        }

    async def _store(self, session: Session, args: p.StoreRequest) -> dict[str, Any]:
        namespace = self._ready(session, "store")
        self._check_pages(session, "store", args.device_pages, args.snapshots)
        snapshots: dict[str, dict[int, int]] = {}
        for group, pairs in args.snapshots.items():
            given = snapshots.setdefault(group, {})
            for tokens, slot in pairs:
                if given.setdefault(tokens, slot) != slot:
                    raise p.RequestError(
                        p.ErrorCode.BAD_REQUEST,
                        f"store.snapshots.{group}: two snapshots after {tokens} tokens (slots "
                        f"{given[tokens]} and {slot}); give one per prefix length",
                    )
        fence = self._store_fence(session, namespace, args.fence)
        result = await namespace.cache.store(
            args.tokens, args.device_pages, snapshots=snapshots, fence=fence, attachment=session.id
        )
        del fence  # an opened IPC event goes before the reply: the engine may then free its own
        self.metrics.evictions.inc(result.pages_evicted)
        if result.bytes_backed_up:
            self.metrics.moved("backup", result.bytes_backed_up, result.backup_seconds)
        return asdict(result)

    @staticmethod
    def _store_fence(session: Session, namespace: Namespace, handle: bytes | None) -> Fence:
        """What a store's backup waits on: the engine's IPC event (CUDA pools), or nothing
        (`NO_FENCE`): the engine synchronised, or wrote shared memory on the CPU. Never a
        fence of the sidecar's own streams, which order nothing of the engine's."""
        if handle is None:
            return NO_FENCE
        backend = namespace.cache.embedded.backend
        if not backend.pins_host_memory:
            raise p.RequestError(
                p.ErrorCode.BAD_REQUEST,
                "store.fence: an IPC event handle orders CUDA work; this session's pools are "
                "shared memory copied on the CPU (send no fence)",
            )
        try:
            return backend.import_fence(handle)
        except HicacheError as exc:
            raise p.RequestError(p.ErrorCode.BAD_REQUEST, f"store.fence: {exc}") from None

    async def _prefetch(self, session: Session, args: p.Tokens) -> dict[str, Any]:
        namespace = self._readable(session, "prefetch")
        if namespace is None:
            return {"pages_fetched": 0}
        return {"pages_fetched": await namespace.cache.prefetch(args.tokens)}

    async def _load(self, session: Session, args: p.LoadRequest) -> dict[str, Any]:
        namespace = self._ready(session, "load")
        self._check_pages(session, "load", args.device_pages)
        counters = session.counters
        assert counters is not None
        if not session.free_slots:
            raise p.RequestError(
                p.ErrorCode.BUSY,
                f"load: all {counters.slots} load slots hold unreleased loads; release "
                "finished loads (LoadHandle.done() does) or raise service.load_slots",
            )
        slot = session.free_slots.pop()
        load_id = next(self._load_ids)
        num_layers = len(self.layer_map.stage_layer_ids)
        counters.start(slot, load_id, num_layers)
        row = counters.array[slot]

        def on_layer(upto: int, stopped: LayerFailure | None) -> None:  # the copy thread
            if stopped is not None:  # no layer from `upto` on lands: wait_layer raises now
                counters.stop(slot, stopped)
                return
            row[4] = time.monotonic_ns()
            row[1] = upto

        try:
            handle, hit = await namespace.cache.load(
                args.tokens,
                args.device_pages,
                on_layer=on_layer,
                skip_pages=args.skip_pages,
                attachment=session.id,
            )
        except BaseException:
            row[2] = LoadState.FREE
            session.free_slots.append(slot)
            raise
        failed = {group: list(positions) for group, positions in hit.failed.items()}
        if handle is None:
            row[2] = LoadState.FREE
            session.free_slots.append(slot)
            return {"load_id": None, "tokens": 0, "failed": failed}
        entry = LoadEntry(slot, handle)
        session.loads[load_id] = entry

        def finished(result: OpResult) -> None:
            counters.end(slot, _FINAL.get(result.state, LoadState.FAILED), result.error)
            self.metrics.moved("load", result.bytes_moved, result.seconds)
            if entry.released:
                self._free(session, load_id)

        handle.add_done_callback(finished)
        return {
            "load_id": load_id,
            "slot": slot,
            "tokens": hit.tokens_total,
            "num_layers": num_layers,
            "failed": failed,
        }

    def _free(self, session: Session, load_id: int) -> None:
        entry = session.loads.pop(load_id, None)
        if entry is not None and session.counters is not None:
            session.counters.array[entry.slot][2] = LoadState.FREE
            session.free_slots.append(entry.slot)

    def _release(self, session: Session, args: p.Release) -> dict[str, Any]:
        self._ready(session, "release")
        entry = session.loads.get(args.load_id)
        if entry is None:
            raise p.RequestError(
                p.ErrorCode.OUT_OF_RANGE,
                f"release.load_id: {args.load_id} is not a load of this session in flight or "
                "unreleased",
            )
        entry.released = True
        if entry.handle.result is None:
            entry.handle.cancel()  # the engine gave up on it; pins go when it ends
            return {"state": "cancelling"}
        self._free(session, args.load_id)
        return {"state": "released"}

    def _stats(self, session: Session, args: p.Empty) -> dict[str, Any]:
        namespace = self._readable(session, "stats")
        if namespace is None:
            raise p.RequestError(
                p.ErrorCode.NOT_READY,
                f"stats: no engine has registered pools for namespace {session.key} yet",
            )
        return {**namespace_stats(namespace), "l3": store_stats(self.store)}

    def _heartbeat(self, session: Session, args: p.Heartbeat) -> dict[str, Any]:
        for stall in args.layer_stall_s:
            self.metrics.layer_stall.observe(stall)
        self.metrics.starved(args.loads_starved)
        return {"now": time.time()}

    # ---- session end --------------------------------------------------------------------------
