"""The vLLM worker's stores: which of vLLM's blocks a `StoreJob` backs up, and how they go.

Direct (vLLM's blocks are the pool the sidecar maps, `vllm/shared_kv.py`): a store names
vLLM's block ids and the sidecar copies them into L2 itself. The request is sent from a
thread of ours, which only waits on the socket, so vLLM's `wait_for_save` returns at once.
vLLM may hand a block to another request, or zero it, only in a later step; `drain()`, run
from `handle_preemptions` before that step's forward, waits for every reply first, so no
store reads a block once vLLM may write it. A store with no reply in time may still be
running in the sidecar, in the session (epoch) it was sent in (`NoReplyError.epoch`): drain
then waits, up to `settle_timeout_s`, until the client has the sidecar's word that this
session ended with every copy of it (`Client.confirmed`: the client's next call reconnects
and registers vLLM's memory again under a later session, which the sidecar does only once
no other session holds that memory, service/claims.py), or that sidecar process has exited.

Staging (the fallback): vLLM's blocks are copied into staging pages on vLLM's thread, then
the store is sent and waited for; a store with no reply in time keeps its staging pages out
of use (`staging_quarantined`) until its epoch is confirmed over (`Staging.reclaim`).

Lifecycle (all calls on vLLM's worker thread):
    stores = Stores(layer_map, bindings, counters, state_store_block, staging=... | None)
    stores.submit(client, jobs, skip)   # wait_for_save: skip = requests whose load failed
    stores.drain(client)                # handle_preemptions, before the next forward; and
                                        # kv_producer: at wait_for_save (its step ends once
                                        # the sidecar said its pages are in L2)
    stores.close()
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence, Set
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hicache.client import Client, ClientError, NoReplyError, SidecarUnreachableError
from hicache.client.handle import Epoch
from hicache.errors import HicacheError
from hicache.integrations.vllm.binding import LayerBinding
from hicache.integrations.vllm.lookups import refused_field
from hicache.integrations.vllm.plan import NULL_BLOCK, StoreJob
from hicache.integrations.vllm.staging import Staging, WorkerCounters
from hicache.memory import DevicePool
from hicache.model import LayerMap


@dataclass(frozen=True, slots=True)
class StorePlan:
    """Of a job's pages, those with a vLLM block in every layer (per hicache token group), and
    the state groups whose snapshot is taken (the step ended on the job's last page)."""

    positions: dict[str, list[int]]
    snapshot_blocks: dict[int, int]  # vLLM group -> the block holding its state now
    state_groups: list[str]


class Stores:
    def __init__(
        self,
        layer_map: LayerMap,
        bindings: Mapping[int, LayerBinding],
        counters: WorkerCounters,
        state_store_block: Callable[[Sequence[int], int], int | None],
        *,
        page_size_tokens: int,
        staging: Staging | None = None,
        pools: Callable[[], Mapping[str, DevicePool]] = dict,
        stream: Callable[[], Any] = lambda: None,
        settle_timeout_s: float = 60.0,
        retry_after_s: float = 1.0,
        persisted_within_s: float = 0.0,
        on_answered: Callable[[StoreJob, dict[str, Any]], None] | None = None,
    ):
        self.layer_map = layer_map
        self.bindings = dict(bindings)
        self.counters = counters
        self.page = page_size_tokens
        self.staging = staging
        self._pools = pools
        self._stream = stream  # CUDA: vLLM's stream, the store's fence; CPU: None
        self._state_store_block = state_store_block
        self.settle_timeout_s = settle_timeout_s
        self.retry_after_s = retry_after_s
        # kv_producer for another host: each store answered once L3 holds its pages
        self.persisted_within_s = persisted_within_s
        # KV events (`vllm/kv_events.py`): told each answered store with its job
        self._on_answered = on_answered
        # direct: each hicache group's layers in one vLLM group (its block ids are the pages)
        self._vllm_group = {
            g.name: self.bindings[g.layer_ids[0]].vllm_group
            for g in layer_map.groups
            if g.layer_ids[0] in self.bindings
        }
        self._thread: ThreadPoolExecutor | None = None
        self._in_flight: list[tuple[StoreJob, Future[Any]]] = []
        # epochs of ops that got no reply: the sidecar may still copy there until confirmed
        self._unsettled: set[Epoch] = set()

    # ---- planning -------------------------------------------------------------------------

    def plan(self, job: StoreJob) -> StorePlan:
        full = len(job.tokens) // self.page
        snapshot_blocks: dict[int, int] = {}
        positions: dict[str, list[int]] = {}
        for g in self.layer_map.groups:
            layer_ids = [i for i in g.layer_ids if i in self.bindings]
            vgroups = sorted({self.bindings[i].vllm_group for i in layer_ids})
            if g.kind.is_token_cache:
                positions[g.name] = [
                    i
                    for i in range(job.first_page, full)
                    if all(job.block_ids[v][i] != NULL_BLOCK for v in vgroups)
                ]
            elif job.computed_after == len(job.tokens):
                for v in vgroups:
                    block = self._state_store_block(job.block_ids[v], full)
                    if block is not None and block != NULL_BLOCK:
                        snapshot_blocks[v] = block
        state_groups = [
            g.name
            for g in self.layer_map.groups
            if not g.kind.is_token_cache
            and job.computed_after == len(job.tokens)
            and all(
                self.bindings[i].vllm_group in snapshot_blocks
                for i in g.layer_ids
                if i in self.bindings
            )
        ]
        return StorePlan(positions, snapshot_blocks, state_groups)

    # ---- submitting -----------------------------------------------------------------------

    def submit(self, client: Client | None, jobs: Sequence[StoreJob], skip: Set[str]) -> None:
        """The step's stores (`skip`: requests whose load failed this step: their pages were
        computed over blocks the load never filled)."""
        if not jobs:
            return
        if client is None:
            self.counters.store_failures += len(jobs)
            return
        started = time.perf_counter()
        for job in jobs:
            if job.req_id in skip:
                self.counters.stores_skipped_failed_load += 1
                continue
            if self.staging is None:
                self._send(client, job)
            else:
                self._through_staging(client, job, self.staging)
        self.counters.store_on_step_s += time.perf_counter() - started

    def _send(self, client: Client, job: StoreJob) -> None:
        plan = self.plan(job)
        full = len(job.tokens) // self.page
        device_pages: dict[str, list[int | None]] = {}
        for name, positions in plan.positions.items():
            ids = job.block_ids[self._vllm_group[name]]
            keep = set(positions)
            device_pages[name] = [ids[i] if i in keep else None for i in range(full)]
        snapshots = {
            g: {len(job.tokens): plan.snapshot_blocks[self._vllm_group[g]]}
            for g in plan.state_groups
        }
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="hicache-store")
        # the fence recorded here, on vLLM's thread at the hook: its stream's work so far
        fence = client.record_fence(self._stream(), "store")
        pages = sum(len(p) for p in plan.positions.values())
        future = self._thread.submit(
            self._timed, client, list(job.tokens), device_pages, snapshots, fence, job
        )
        self._in_flight.append((job, future))
        self.counters.pages_stored += pages

    def _timed(
        self,
        client: Client,
        tokens: list[int],
        device_pages: dict[str, list[int | None]],
        snapshots: dict[str, dict[int, int]],
        fence: tuple[Any, bytes | None],
        job: StoreJob,
    ) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            return self._store(client, tokens, device_pages, snapshots, fence, job)
        finally:
            self.counters.store_s += time.perf_counter() - started

    def _store(
        self,
        client: Client,
        tokens: list[int],
        device_pages: dict[str, list[int | None]],
        snapshots: dict[str, dict[int, int]],
        fence: tuple[Any, bytes | None] | None = None,
        job: StoreJob | None = None,
    ) -> dict[str, Any]:
        """`client.store`, asking for L3 when configured and `job` completes its prompt
        (earlier chunks' stores are answered at L2: their pages are queued for L3 ahead of
        the last chunk's, which the sidecar waits for whole); a sidecar that predates that
        is said once and asked without it from then on (its stores answered at L2)."""
        completes = job is not None and job.completes_prompt
        try:
            return client.store(
                tokens,
                device_pages,
                snapshots,
                fence=fence,
                persisted_within_s=self.persisted_within_s if completes else 0.0,
            )
        except ClientError as exc:
            if not refused_field(exc, "persisted_within_s"):
                raise
            self.counters.error(
                f"kv_connector_extra_config.persisted_within_s {self.persisted_within_s:g}: "
                f"the sidecar predates it; stores are answered at L2 from now on ({exc})"
            )
            self.persisted_within_s = 0.0
            return client.store(tokens, device_pages, snapshots, fence=fence)

    def _through_staging(self, client: Client, job: StoreJob, staging: Staging) -> None:
        plan = self.plan(job)
        full = len(job.tokens) // self.page
        wanted = {g: len(p) for g, p in plan.positions.items()} | dict.fromkeys(
            plan.state_groups, 1
        )
        pages = staging.take(wanted)
        if pages is None:
            self.counters.stores_skipped_staging += 1
            self.counters.error(
                f"request {job.req_id}: its store needs {wanted} staging pages; free now: "
                f"{staging.free()} of {staging.num_pages}; not stored (raise staging_pages)"
            )
            return
        started = time.perf_counter()
        try:
            pools = self._pools()
            device_pages: dict[str, list[int | None]] = {}
            for name, positions in plan.positions.items():
                where = dict(zip(positions, pages[name], strict=True))
                device_pages[name] = [where.get(i) for i in range(full)]
            for binding in self.bindings.values():
                pool = pools[binding.group]
                if binding.group in plan.positions:
                    positions = plan.positions[binding.group]
                    if positions:
                        ids = job.block_ids[binding.vllm_group]
                        binding.to_staging(pool, [ids[i] for i in positions], pages[binding.group])
                elif binding.group in plan.state_groups:
                    block = plan.snapshot_blocks[binding.vllm_group]
                    binding.to_staging(pool, [block], pages[binding.group])
            snapshots = {g: {len(job.tokens): pages[g][0]} for g in plan.state_groups}
            # No fence: staging is shared host memory and `to_staging`'s copies are blocking,
            # so the pages are written before the request leaves (`Client.store`'s CPU rule).
            reply = self._store(client, list(job.tokens), device_pages, snapshots, job=job)
            self._answered(job, reply)
            self.counters.pages_stored += sum(len(p) for p in plan.positions.values())
        except (HicacheError, OSError) as exc:
            self.counters.store_failures += 1
            self.counters.error(f"request {job.req_id}: store failed: {exc}")
            if unanswered(exc):
                # no answer: the sidecar may still be backing the store up from these pages;
                # handed to the next store before its session ended they would be
                # overwritten under this prompt's keys (another prompt's bytes filed and
                # served as this one's)
                staging.quarantine(pages, epoch_of(exc, client))
                self.counters.staging_quarantined += sum(len(p) for p in pages.values())
                pages = {}
        finally:
            staging.give(pages)
            self.counters.store_s += time.perf_counter() - started

    # ---- before vLLM may write a stored block again ---------------------------------------

    def unsettle(self, epoch: Epoch) -> None:
        """An op of `epoch` got no reply (a load's start, say): the next `drain` waits until
        the sidecar confirmed that session's end, as for a store."""
        self._unsettled.add(epoch)

    def drain(self, client: Client | None) -> None:
        """Every store sent so far answered (or its session confirmed over): from here on
        vLLM may overwrite any block a store named."""
        if not self._in_flight and not self._unsettled:
            return
        started = time.perf_counter()
        in_flight, self._in_flight = self._in_flight, []
        for job, future in in_flight:
            self._reply_of(job, future, client)  # the client's socket timeout bounds it
        if self._unsettled and client is not None:
            self._settle(client)
        self.counters.store_on_step_s += time.perf_counter() - started

    def harvest(self, client: Client | None) -> None:
        """The stores answered by now, taken without waiting for the others (KV events
        report them in this step's output rather than after the next step's drain)."""
        if not any(future.done() for _, future in self._in_flight):
            return
        pending: list[tuple[StoreJob, Future[Any]]] = []
        for job, future in self._in_flight:
            if future.done():
                self._reply_of(job, future, client)
            else:
                pending.append((job, future))
        self._in_flight = pending

    def _reply_of(self, job: StoreJob, future: Future[Any], client: Client | None) -> None:
        try:
            self._answered(job, future.result())
        except (HicacheError, OSError) as exc:
            self.counters.store_failures += 1
            self.counters.error(f"request {job.req_id}: store failed: {exc}")
            if unanswered(exc) and client is not None:  # it may still read vLLM's blocks
                self._unsettled.add(epoch_of(exc, client))

    def _answered(self, job: StoreJob, reply: dict[str, Any]) -> None:
        """A store's reply: L2 holds every page it named, or only a prefix (L2 too full)."""
        if self._on_answered is not None:
            self._on_answered(job, reply)
        self.counters.stores += 1
        if reply.get("truncated_to_tokens") is None:
            self.counters.stores_in_l2 += 1
        else:
            self.counters.stores_truncated += 1
        if "persisted" in reply:  # asked for: L3 holds every page, or not by the bound
            if reply["persisted"]:
                self.counters.stores_persisted += 1
            else:
                self.counters.stores_not_persisted += 1

    def _settle(self, client: Client) -> None:
        """Wait until the sidecar confirmed every unsettled epoch over (`Client.confirmed`):
        each try is a call, which reconnects and registers vLLM's memory again, refused (or
        held) while a session of an unsettled epoch still holds it; or until that sidecar
        process exited. Up to `settle_timeout_s`; then vLLM goes on, and it is counted."""
        deadline = time.monotonic() + self.settle_timeout_s
        reason = "no try yet"
        while True:
            self._unsettled = {e for e in self._unsettled if not client.confirmed(e)}
            if not self._unsettled:
                return
            if time.monotonic() > deadline:
                self.counters.stores_unconfirmed += len(self._unsettled)
                sessions = sorted(e.session for e in self._unsettled)
                self.counters.error(
                    f"ops of sessions {sessions} got no reply and the sidecar did not confirm "
                    f"their end in {self.settle_timeout_s:g} s ({reason}); vLLM goes on writing "
                    "its blocks"
                )
                self._unsettled = set()
                return
            try:
                client.stats()
                reason = f"registered again under session {client.now().session}"
            except (HicacheError, OSError) as exc:
                reason = str(exc)
            if any(not client.confirmed(e) for e in self._unsettled):
                time.sleep(self.retry_after_s)

    def close(self) -> None:
        if self._thread is not None:
            for _, future in self._in_flight:
                with contextlib.suppress(Exception):
                    future.result()
            self._in_flight = []
            self._thread.shutdown(wait=True)
            self._thread = None


def unanswered(exc: BaseException) -> bool:
    """A failure after which the op may still run in the sidecar: no reply in time, or the
    connection gone (an error the sidecar answered settles its op)."""
    return not isinstance(exc, HicacheError) or isinstance(exc, SidecarUnreachableError)


def epoch_of(exc: BaseException, client: Client) -> Epoch:
    """The epoch an unanswered op may still run in: the one `NoReplyError` names, else the
    latest session the client said hello in (no op of it ran in a later one)."""
    return exc.epoch if isinstance(exc, NoReplyError) else client.now()
