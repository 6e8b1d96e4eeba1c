"""`DataOps`: an engine session's data ops — `store` (its pages backed up into L2, L3 behind),
`load` (a hit copied into its pools layer by layer, progress in its counter file), both also
by the engine's own page keys (`store_keys` / `load_keys`: an engine that has page hashes of
its own and no tokens to send, as SGLang's storage backends do), `prefetch`
(L3 -> L2 ahead of a load) and `release` (a load the engine is done with) — over the server's
explicit state (`ServerState`).

Lifecycle of a load: a free slot of the session's counter file is taken -> the cache's load
runs, each landed layer written to the slot from the copy thread -> its end marks the slot's
final state -> `release` frees the slot (or cancels a load still running; its slot is freed
when it ends). Every page a store or load names is checked against the session's registered
pools first (`_check_pages`). A store's and a load's reply names its session (`session`,
the epoch), whose end settles every copy it started. A store with `persisted_within_s`
answers once L3 holds its pages, or at that bound (`persisted`: whether it does;
`cache/writing.py`), for a decode instance on another host (or, by keys, for SGLang's MLA
ranks other than 0, which read rank 0's latents from L3); its wait ends at once, False,
when its engine's connection is gone (`Session.gone`) or the drain begins."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from hicache.cache import StoreResult
from hicache.cache.writing import until_persisted
from hicache.channel import protocol as p
from hicache.channel.counters import LoadState
from hicache.errors import HicacheError
from hicache.index import Hit, PageKey
from hicache.scheduler import OpHandle, OpResult, OpState
from hicache.service.checkpoints import checkpoint
from hicache.service.kv_events import storing_tokens
from hicache.service.namespaces import Namespace
from hicache.service.ops_lookup import check_groups, packed_keys
from hicache.service.sessions import LoadEntry, Session
from hicache.service.state import ServerState
from hicache.transfer import NO_FENCE, CopyBackend, Fence, LayerFailure, LayerListener

_FINAL = {
    OpState.DONE: LoadState.DONE,
    OpState.FAILED: LoadState.FAILED,
    OpState.CANCELLED: LoadState.CANCELLED,
    OpState.EXPIRED: LoadState.FAILED,
}


class DataOps:
    def __init__(self, state: ServerState):
        self.state = state

    async def store(self, session: Session, args: p.StoreRequest) -> dict[str, Any]:
        namespace = self.state.ready(session, "store")
        self._check_pages(session, "store", args.device_pages, args.snapshots)
        snapshots = _snapshots("store", args.snapshots)
        fence = engine_fence(namespace.cache.backend, args.fence, "store")
        await checkpoint("store.begin")
        # KV events (service.kv_events) hash the pages this store brings into L2
        with storing_tokens(self.state.kv_events, namespace.cache.index, args.tokens):
            result = await namespace.cache.store(
                args.tokens,
                args.device_pages,
                snapshots=snapshots,
                fence=fence,
                attachment=session.id,
            )
        del fence  # an opened IPC event goes before the reply: the engine may then free its own
        reply = self._stored(session, result)
        if args.persisted_within_s > 0:  # the pages in L3, for a decode host reading L3
            keys = namespace.cache.index.keys(args.tokens)
            reply["persisted"] = await self._persisted(
                session, namespace, keys, args.persisted_within_s
            )
        return reply

    async def _persisted(
        self,
        session: Session,
        namespace: Namespace,
        keys: Mapping[str, Sequence[PageKey]],
        within_s: float,
    ) -> bool:
        """`until_persisted` for a store's pages of the token groups this rank writes (state
        snapshots: boundaries; a replicated group on a rank other than 0: rank 0's)."""
        cache = namespace.cache
        return await until_persisted(
            cache.index,
            cache.persist,
            {
                group: group_keys
                for group, group_keys in keys.items()
                if cache.index.rules[group].kind.is_token_cache
                and group not in cache.stores.replica_groups
            },
            within_s,
            # no one reads the reply once the engine is gone; the drain answers it now
            stops=(session.gone, self.state.store_waits.stopping),
        )

    async def store_keys(self, session: Session, args: p.KeyedStore) -> dict[str, Any]:
        """`store` of a prompt given by the engine's own page keys (state groups' snapshots
        by the number of tokens the keys up to them cover)."""
        namespace = self.state.ready(session, "store_keys")
        keys, _ = packed_keys(self.state, args.keys, None, "store_keys")
        self._check_pages(session, "store_keys", args.device_pages, args.snapshots)
        self._check_counts("store_keys", keys, args.device_pages)
        snapshots = _snapshots("store_keys", args.snapshots)
        fence = engine_fence(namespace.cache.backend, args.fence, "store_keys")
        await checkpoint("store.begin")
        result = await namespace.cache.store_keys(
            keys, args.device_pages, snapshots=snapshots, fence=fence, attachment=session.id
        )
        del fence
        reply = self._stored(session, result)
        if args.persisted_within_s > 0:  # the pages in L3: SGLang's MLA writer (rank 0)
            cut = result.truncated_to_tokens  # L2 held this prefix: the pages stored
            pages = None if cut is None else cut // namespace.cache.index.page_size_tokens
            stored = {group: group_keys[:pages] for group, group_keys in keys.items()}
            reply["persisted"] = await self._persisted(
                session, namespace, stored, args.persisted_within_s
            )
        return reply

    def _stored(self, session: Session, result: StoreResult) -> dict[str, Any]:
        self.state.metrics.evictions.inc(result.pages_evicted)
        if result.bytes_backed_up:
            self.state.metrics.moved("backup", result.bytes_backed_up, result.backup_seconds)
        return {**asdict(result), "session": session.id}

    async def prefetch(self, session: Session, args: p.Tokens) -> dict[str, Any]:
        namespace = self.state.readable(session, "prefetch")
        if namespace is None:
            return {"pages_fetched": 0}
        return {"pages_fetched": await namespace.cache.prefetch(args.tokens)}

    async def load(self, session: Session, args: p.LoadRequest) -> dict[str, Any]:
        namespace = self.state.ready(session, "load")
        self._check_pages(session, "load", args.device_pages)

        def start(fence: Fence, on_layer: LayerListener) -> Awaitable[tuple[OpHandle | None, Hit]]:
            return namespace.cache.load(
                args.tokens,
                args.device_pages,
                on_layer=on_layer,
                skip_pages=args.skip_pages,
                fence=fence,
                attachment=session.id,
            )

        return await self._load(session, namespace, "load", args.fence, start)

    async def load_keys(self, session: Session, args: p.KeyedLoad) -> dict[str, Any]:
        """`load` of a prompt given by the engine's own page keys (of `groups` alone, when
        named: their device pages only)."""
        namespace = self.state.ready(session, "load_keys")
        keys, _ = packed_keys(self.state, args.keys, None, "load_keys")
        groups = check_groups(self.state, args.groups, "load_keys")
        self._check_pages(session, "load_keys", args.device_pages, groups=groups)
        self._check_counts("load_keys", keys, args.device_pages)

        def start(fence: Fence, on_layer: LayerListener) -> Awaitable[tuple[OpHandle | None, Hit]]:
            return namespace.cache.load_keys(
                keys,
                args.device_pages,
                on_layer=on_layer,
                skip_pages=args.skip_pages,
                fence=fence,
                attachment=session.id,
                groups=groups,
                l3_wait_s=args.l3_wait_s,
            )

        return await self._load(session, namespace, "load_keys", args.fence, start)

    def _check_counts(
        self,
        op: str,
        keys: Mapping[str, Sequence[PageKey]],
        device_pages: Mapping[str, Sequence[int | None]],
    ) -> None:
        """A keyed op's token groups name a device page per key (state groups: one slot)."""
        for group, pages in device_pages.items():
            if not self.state.layer_map.group(group).kind.is_token_cache:
                continue
            wanted = len(keys[group]) if group in keys else len(pages)
            if len(pages) != wanted:
                raise p.RequestError(
                    p.ErrorCode.BAD_REQUEST,
                    f"{op}.device_pages.{group}: {len(pages)} pages for {wanted} keys; give "
                    "one device page per page key",
                )

    async def _load(
        self,
        session: Session,
        namespace: Namespace,
        op: str,
        fence_handle: bytes | None,
        start: Callable[[Fence, LayerListener], Awaitable[tuple[OpHandle | None, Hit]]],
    ) -> dict[str, Any]:
        counters = session.counters
        assert counters is not None
        if not session.free_slots:
            raise p.RequestError(
                p.ErrorCode.BUSY,
                f"{op}: all {counters.slots} load slots hold unreleased loads; release "
                "finished loads (LoadHandle.done() does) or raise service.load_slots",
            )
        slot = session.free_slots.pop()
        load_id = next(self.state.load_ids)
        num_layers = len(self.state.layer_map.stage_layer_ids)
        counters.start(slot, load_id, num_layers)
        row = counters.array[slot]

        def on_layer(upto: int, stopped: LayerFailure | None) -> None:  # the copy thread
            if stopped is not None:  # no layer from `upto` on lands: wait_layer raises now
                counters.stop(slot, stopped)
                return
            row[4] = time.monotonic_ns()
            row[1] = upto

        try:
            fence = engine_fence(namespace.cache.backend, fence_handle, op)
            await checkpoint("load.begin")
            handle, hit = await start(fence, on_layer)
            del fence  # held by the walk's op until it ends (the scheduler drops it then)
        except BaseException:
            row[2] = LoadState.FREE
            session.free_slots.append(slot)
            raise
        failed = {group: list(positions) for group, positions in hit.failed.items()}
        if handle is None:
            row[2] = LoadState.FREE
            session.free_slots.append(slot)
            return {"load_id": None, "tokens": 0, "failed": failed, "session": session.id}
        entry = LoadEntry(slot, handle)
        session.loads[load_id] = entry

        def finished(result: OpResult) -> None:
            counters.end(slot, _FINAL.get(result.state, LoadState.FAILED), result.error)
            self.state.metrics.moved("load", result.bytes_moved, result.seconds)
            if entry.released:
                self._free(session, load_id)

        handle.add_done_callback(finished)
        return {
            "load_id": load_id,
            "slot": slot,
            "tokens": hit.tokens_total,
            "num_layers": num_layers,
            "failed": failed,
            "session": session.id,  # the epoch: which session's end settles this load
        }

    def _free(self, session: Session, load_id: int) -> None:
        entry = session.loads.pop(load_id, None)
        if entry is not None and session.counters is not None:
            session.counters.array[entry.slot][2] = LoadState.FREE
            session.free_slots.append(entry.slot)

    def release(self, session: Session, args: p.Release) -> dict[str, Any]:
        self.state.ready(session, "release")
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

    def _check_pages(
        self,
        session: Session,
        op: str,
        device_pages: Mapping[str, Sequence[int | None]],
        snapshots: Mapping[str, Sequence[Sequence[int]]] | None = None,
        *,
        groups: Sequence[str] | None = None,
    ) -> None:
        """Every page named is inside the engine's registered pool; a load names every group
        (of `groups`, when it moves those alone), a store every token group (its state
        groups' snapshots come in `snapshots`)."""
        assert session.pools is not None
        named = dict(device_pages)
        for group, pairs in (snapshots or {}).items():
            self._check_in_pool(session, f"{op}.snapshots", group, [slot for _, slot in pairs])
        for group, pages in named.items():
            self._check_in_pool(session, f"{op}.device_pages", group, pages)
        required = set(session.pools) if groups is None else set(groups)
        if snapshots is not None:
            required = {g for g in required if self.state.layer_map.group(g).kind.is_token_cache}
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


def _snapshots(op: str, given: Mapping[str, Sequence[Sequence[int]]]) -> dict[str, dict[int, int]]:
    """A store's snapshots as `{group: {num_tokens: slot}}`; two for one length refused."""
    snapshots: dict[str, dict[int, int]] = {}
    for group, pairs in given.items():
        got = snapshots.setdefault(group, {})
        for tokens, slot in pairs:
            if got.setdefault(tokens, slot) != slot:
                raise p.RequestError(
                    p.ErrorCode.BAD_REQUEST,
                    f"{op}.snapshots.{group}: two snapshots after {tokens} tokens (slots "
                    f"{got[tokens]} and {slot}); give one per prefix length",
                )
    return snapshots


def engine_fence(backend: CopyBackend, handle: bytes | None, op: str) -> Fence:
    """What a store's backup or a load's copies wait on (`op` names which, for errors): the
    engine's IPC event (CUDA pools), or nothing (`NO_FENCE`): the engine synchronised, or
    works on shared memory on the CPU. Never a fence of the sidecar's own streams, which
    order nothing of the engine's."""
    if handle is None:
        return NO_FENCE
    if not backend.pins_host_memory:
        raise p.RequestError(
            p.ErrorCode.BAD_REQUEST,
            f"{op}.fence: an IPC event handle orders CUDA work; this session's pools are "
            "shared memory copied on the CPU (send no fence)",
        )
    try:
        return backend.import_fence(handle)
    except HicacheError as exc:
        raise p.RequestError(p.ErrorCode.BAD_REQUEST, f"{op}.fence: {exc}") from None
