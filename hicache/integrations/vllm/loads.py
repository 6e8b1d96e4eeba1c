"""The vLLM worker's loads: each step's `LoadJob`s into vLLM's blocks, and what vLLM is told
of those that failed.

Direct (vLLM's blocks are the pool the sidecar maps, `vllm/shared_kv.py`): a load names
vLLM's block ids and the sidecar's copies are the only ones; on CUDA they wait for vLLM's
stream (its zeroing of the blocks it allocated this step) through the load's fence. Staging
(the fallback): the sidecar fills staging pages, and each layer is copied into vLLM's blocks
on vLLM's thread once it landed.

Three ways a step loads: layer-wise (`start` then vLLM's `wait_layer` per layer: the sidecar
moves layer i+1 while the forward computes layer i), whole (every layer landed before the
forward: the baseline of the layer-wise figure), asynchronous (between steps, for models with
several KV-cache groups: `start_async`, then `poll_async` once per step). Failures never
raise into vLLM: a layer-wise load's blocks go to `take_errors` (vLLM recomputes them) and its
request to `failed_requests` (the pages that step computed over stale blocks are not
stored); an asynchronous one's request to `poll_async`'s failed set.

A load that did not end in time may still be writing: its staging pages stay out of use
(`staging_quarantined`) until the sidecar confirmed its session (epoch) over
(`Staging.reclaim`), or, direct, it is waited for before the next forward (`await_unended`,
from `handle_preemptions`), since vLLM reuses the blocks from then on: until the sidecar says
it ended (its counter row), or, its connection gone, until the sidecar confirmed its session
over (`Stores.unsettle`, settled by `Stores.drain`). A direct load whose start got no reply
is settled the same way.

Lifecycle (all on vLLM's worker thread):
    loads = Loads(layer_map, bindings, counters, stores, staging, ...)
    loads.start(client, jobs)          # start_load_kv
    loads.wait_layer(layer_id)         # wait_for_layer_load
    loads.finish()                     # wait_for_save: ended, handles released
    loads.take_errors()                # get_block_ids_with_load_errors
    loads.start_async(client, jobs)    # multi-group models: loads between steps
    loads.poll_async()                 # get_transfer_results
    loads.await_unended()              # handle_preemptions, before the next forward
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hicache.client import Client, LoadHandle
from hicache.errors import HicacheError
from hicache.integrations.vllm.binding import LayerBinding
from hicache.integrations.vllm.plan import NULL_BLOCK, LoadJob
from hicache.integrations.vllm.staging import Staging, WorkerCounters
from hicache.integrations.vllm.stores import Stores, epoch_of, unanswered
from hicache.memory import DevicePool
from hicache.model import CacheKind, LayerMap


@dataclass
class _Move:
    """One layer's copies for one job: staging pages <-> vLLM block ids."""

    binding: LayerBinding
    pages: list[int]
    blocks: list[int]


@dataclass
class _ActiveLoad:
    job: LoadJob
    handle: LoadHandle | None
    staging: dict[str, list[int]]
    moves: dict[int, list[_Move]]  # layer id -> copies once it lands
    failed: bool = False
    reported: bool = False  # its blocks are in the step's load errors
    layerwise: bool = False  # a step's synchronous load (vLLM can keep a leading part)
    deadline: float = 0.0  # an asynchronous load still running then is given up


class Loads:
    def __init__(
        self,
        layer_map: LayerMap,
        bindings: Mapping[int, LayerBinding],
        counters: WorkerCounters,
        stores: Stores,
        staging: Staging,
        staging_pages: Mapping[str, int],
        pools: Callable[[], Mapping[str, DevicePool]],
        *,
        direct: bool,
        page_size_tokens: int,
        load_timeout_s: float,
        retry_after_s: float,
        state_load_block: Callable[[Sequence[int], int], int],
        stream: Callable[[], Any],
    ):
        """`pools`: the staging pools of the worker's client now (staging only). `stream`:
        CUDA, vLLM's current stream (a direct load's fence); CPU, None."""
        self.layer_map = layer_map
        self.bindings = dict(bindings)
        self.counters = counters
        self.stores = stores
        self.staging = staging
        self._staging_pages = dict(staging_pages)
        self._pools = pools
        self.direct = direct
        self.page = page_size_tokens
        self.load_timeout_s = load_timeout_s
        self.retry_after_s = retry_after_s
        self._state_load_block = state_load_block
        self._stream = stream
        self._order = [i for i in layer_map.stage_layer_ids if i in self.bindings]
        # every group keeps every page of a prefix: a shorter load is a usable leading part
        self._prefix_kinds = all(
            g.kind in (CacheKind.FULL, CacheKind.SPARSE) for g in layer_map.groups
        )
        self._state_layers = [
            i
            for i in self._order
            if not layer_map.group(self.bindings[i].group).kind.is_token_cache
        ]
        self._active: list[_ActiveLoad] = []
        self._pending: list[int] = []  # layers of this step's loads not yet copied, in order
        self._errors: set[int] = set()
        self._async: dict[str, _ActiveLoad] = {}
        # requests whose load failed this step: their pages computed over stale blocks
        # must not be stored (vLLM recomputes them next step)
        self.failed_requests: set[str] = set()
        # direct loads that had not ended when the step did: they may still write vLLM's
        # blocks, which vLLM reuses (recomputing, or for another request) from the next step
        self._unended: list[tuple[str, LoadHandle]] = []

    def cancel_async(self) -> None:
        """The process is ending: running asynchronous loads are cancelled (their staging
        goes with the client's file)."""
        for active in self._async.values():
            if active.handle is not None:
                with contextlib.suppress(Exception):
                    active.handle.cancel()
        self._async = {}

    # No thread of ours copies: on vLLM's CPU worker both cores are busy (the forward's
    # OpenMP threads, the engine loop stepping between requests), and a copy thread beside
    # them ran at a fraction of memcpy speed. The sidecar fills staging in its own process;
    # this side copies a layer into vLLM's blocks on vLLM's thread once it landed: in
    # `wait_layer` (layer-wise: the sidecar moves layer i+1 while the forward computes layer
    # i), or between steps (asynchronous loads, `poll_async`).

    def start(self, client: Client | None, jobs: Sequence[LoadJob], *, whole: bool = False) -> None:
        """Synchronous loads of this step (vLLM waits for them inside the forward). `whole`:
        every layer lands and is copied before the forward starts (no overlap; the baseline
        of the layer-wise figure)."""
        self.finish()  # a step that never reached wait_for_save (should not happen)
        if not jobs:
            return
        for job in jobs:
            active = self._start_one(client, job, layerwise=True)
            self._active.append(active)
            if active.failed:
                self._fail(active)
        self._pending = list(self._order)
        waits = self._order if whole else self._state_layers  # no hook reaches state layers
        for layer_id in waits:
            self.wait_layer(layer_id)

    def wait_layer(self, layer_id: int) -> None:
        """Every load's `layer_id` in vLLM's blocks (and every layer before it, in order)."""
        if not self._pending or layer_id not in self._pending:
            return
        started = time.perf_counter()
        while self._pending:
            current = self._pending.pop(0)
            for active in self._active:
                self._land(active, current)
            if current == layer_id:
                break
        self.counters.layer_wait_s += time.perf_counter() - started

    def _land(self, active: _ActiveLoad, layer_id: int) -> None:
        if active.failed or active.handle is None:
            return
        try:
            active.handle.wait_layer(layer_id, timeout_s=self.load_timeout_s)
        except Exception as exc:  # a failed or lost layer: vLLM recomputes the request
            self.counters.error(f"request {active.job.req_id}: layer {layer_id}: {exc}")
            active.failed = True
            return
        self._copy(active, layer_id)

    def _copy(self, active: _ActiveLoad, layer_id: int) -> None:
        if not active.moves:  # direct: the sidecar's copy was the only one
            return
        started = time.perf_counter()
        for move in active.moves.get(layer_id, ()):
            move.binding.from_staging(self._pools()[move.binding.group], move.pages, move.blocks)
        self.counters.load_copy_s += time.perf_counter() - started

    def finish(self) -> None:
        """After the forward: every layer of this step's loads landed (or failed), handles
        released, staging given back, failures recorded for vLLM."""
        if not self._active:
            return
        if self._pending:  # a layer the forward never waited for: it may have read it stale
            self.counters.error(
                f"layers {self._pending} of this step's loads were never waited for by the "
                "forward; their requests are recomputed"
            )
            for active in self._active:
                active.failed = True
            self._pending = []
        for active in self._active:
            self._end(active)
            if active.failed:
                self._fail(active)
        self._active = []
        self._pending = []

    def _end(self, active: _ActiveLoad) -> bool:
        """Wait for the sidecar to finish with the load (it may still be writing staging),
        release it, then give its staging back. A load that does not end in time keeps its
        staging pages out of use for good (`staging_quarantined`): a late write into a
        page handed to another load or store would be served."""
        handle = active.handle
        ended = True
        if handle is not None:
            try:
                if handle.done(timeout_s=self.load_timeout_s) != "done":
                    active.failed = True
            except Exception as exc:  # no end in time, or the connection is gone
                self.counters.error(f"request {active.job.req_id}: load end: {exc}")
                active.failed = True
                ended = False
                with contextlib.suppress(Exception):
                    handle.cancel()
        if ended:
            self.staging.give(active.staging)
        elif self.direct and handle is not None:
            self._unended.append((active.job.req_id, handle))
        else:
            assert handle is not None  # only a started load can fail to end
            self.staging.quarantine(active.staging, handle.epoch)
            self.counters.staging_quarantined += sum(len(p) for p in active.staging.values())
        active.staging = {}
        return ended

    def _fail(self, active: _ActiveLoad) -> None:
        if active.reported:
            return
        active.reported = True
        self.counters.load_failures += 1
        self.failed_requests.add(active.job.req_id)
        pages = len(active.job.tokens) // self.page
        for ids in active.job.block_ids:
            self._errors.update(b for b in ids[active.job.skip_pages : pages] if b != NULL_BLOCK)

    def take_errors(self) -> set[int]:
        self.finish()
        errors, self._errors = self._errors, set()
        return errors

    def start_async(self, client: Client | None, jobs: Sequence[LoadJob]) -> None:
        """Loads vLLM waits for between steps (the request sits in WAITING_FOR_REMOTE_KVS):
        the sidecar fills staging meanwhile; `poll_async` copies each once it ended."""
        if not jobs:
            return
        for job in jobs:
            self._async[job.req_id] = self._start_one(client, job)

    def poll_async(self) -> tuple[set[str], set[str]]:
        """Asynchronous loads that ended since the last call, copied into vLLM's blocks:
        (all of them, the failed). Called once per step; never waits for a running load,
        except past its deadline."""
        done: set[str] = set()
        failed: set[str] = set()
        for req_id, active in list(self._async.items()):
            ok = self._settle(active)
            if ok is None:
                continue
            del self._async[req_id]
            done.add(req_id)
            if not ok:
                failed.add(req_id)
                self.counters.load_failures += 1
        return done, failed

    def _settle(self, active: _ActiveLoad) -> bool | None:
        """True: landed and copied; False: failed (ended, staging back or quarantined);
        None: still running."""
        handle = active.handle
        if handle is None:
            self.staging.give(active.staging)
            active.staging = {}
            return False
        if not active.failed:
            try:
                state = handle.state()
            except Exception as exc:  # the sidecar went away mid-load: vLLM recomputes
                self.counters.error(f"request {active.job.req_id}: load lost: {exc}")
                state = "lost"
            if state == "running" and time.monotonic() < active.deadline:
                return None
            if state == "running":
                self.counters.error(
                    f"request {active.job.req_id}: load still running after its deadline; "
                    "recomputed"
                )
            if state != "done":
                active.failed = True
        if active.failed:
            self._end(active)
            return False
        for layer_id in self._order:  # the load ended: staging holds every layer
            self._copy(active, layer_id)
        return self._end(active) and not active.failed

    def _start_one(
        self, client: Client | None, job: LoadJob, *, layerwise: bool = False
    ) -> _ActiveLoad:
        pages = len(job.tokens) // self.page
        wanted = {
            g.name: (pages - job.skip_pages) if g.kind.is_token_cache else 1
            for g in self.layer_map.groups
        }
        active = _ActiveLoad(job, None, {}, {}, layerwise=layerwise)
        active.deadline = time.monotonic() + self.load_timeout_s * max(1, len(self._order))
        if client is None:
            active.failed = True
            return active
        if self.direct:
            blocks = self._direct_pages(job, pages)
            if blocks is None:
                active.failed = True
                return active
            return self._request(client, job, active, blocks, {})
        staging = self.staging.take(wanted)
        if staging is None:
            self.counters.loads_starved += 1
            client.starved()
            self.counters.error(
                f"request {job.req_id}: its load needs {wanted} staging pages; free now: "
                f"{self.staging.free()} of {self._staging_pages}; recomputed (raise "
                "staging_pages)"
            )
            active.failed = True
            return active
        active.staging = staging
        device_pages: dict[str, list[int]] = {}
        for g in self.layer_map.groups:
            given = staging[g.name]
            if g.kind.is_token_cache:
                device_pages[g.name] = [0] * job.skip_pages + given  # 0: the scratch page
            else:
                device_pages[g.name] = given
        for layer_id in self._order:
            binding = self.bindings[layer_id]
            ids = job.block_ids[binding.vllm_group]
            if self.layer_map.group(binding.group).kind.is_token_cache:
                pairs = [
                    (staging[binding.group][i - job.skip_pages], ids[i])
                    for i in range(job.skip_pages, pages)
                    if ids[i] != NULL_BLOCK
                ]
            else:
                block = self._state_load_block(ids, pages)
                if block == NULL_BLOCK:  # vLLM gave no block for the state: never write 0
                    self.counters.error(
                        f"request {job.req_id}: vLLM gave layer {layer_id}'s state no block "
                        f"for a snapshot after {pages} pages; recomputed"
                    )
                    active.failed = True
                    return active
                pairs = [(staging[binding.group][0], block)]
            if pairs:
                active.moves.setdefault(layer_id, []).append(
                    _Move(
                        binding,
                        [p for p, _ in pairs],
                        [b for _, b in pairs],
                    )
                )
        return self._request(client, job, active, device_pages, staging)

    def _direct_pages(self, job: LoadJob, pages: int) -> dict[str, list[int]] | None:
        """A direct load's pages: vLLM's block ids (a token group's null blocks are positions
        vLLM dropped from a window; the sidecar's window selection never writes them)."""
        device_pages: dict[str, list[int]] = {}
        for g in self.layer_map.groups:
            ids = job.block_ids[self.bindings[g.layer_ids[0]].vllm_group]
            if g.kind.is_token_cache:
                device_pages[g.name] = list(ids[:pages])
                continue
            block = self._state_load_block(ids, pages)
            if block == NULL_BLOCK:  # vLLM gave no block for the state: never write block 0
                self.counters.error(
                    f"request {job.req_id}: vLLM gave group {g.name!r}'s state no block for a "
                    f"snapshot after {pages} pages; recomputed"
                )
                return None
            device_pages[g.name] = [block]
        return device_pages

    def _request(
        self,
        client: Client,
        job: LoadJob,
        active: _ActiveLoad,
        device_pages: dict[str, list[int]],
        staging: dict[str, list[int]],
    ) -> _ActiveLoad:
        pages = len(job.tokens) // self.page
        started = time.perf_counter()
        try:
            if job.from_l3:  # bring L3's pages to L2 first: the load itself waits briefly
                client.prefetch(list(job.tokens))
            # direct on CUDA: after vLLM's zeroing of the blocks it allocated this step (its
            # stream, now: start_load_kv runs after the runner queued that zeroing)
            stream = self._stream() if self.direct else None
            handle = client.load(
                list(job.tokens), device_pages, skip_pages=job.skip_pages, stream=stream
            )
        except (HicacheError, OSError) as exc:
            self.counters.error(f"request {job.req_id}: load failed to start: {exc}")
            active.failed = True
            if unanswered(exc):  # the sidecar may be filling staging (or blocks) still
                epoch = epoch_of(exc, client)
                self.staging.quarantine(staging, epoch)
                self.counters.staging_quarantined += sum(len(p) for p in staging.values())
                active.staging = {}
                if self.direct:  # vLLM's blocks: settled before the next forward
                    self.stores.unsettle(epoch)
            return active
        finally:
            self.counters.load_request_s += time.perf_counter() - started
        active.handle = handle
        got = 0 if handle is None else handle.tokens
        if got >= len(job.tokens):
            self.counters.loads += 1
            self.counters.pages_loaded += pages - job.skip_pages
        elif active.layerwise and self._prefix_kinds and got // self.page > job.skip_pages:
            self._keep_leading(active, got // self.page)
        else:
            self.counters.error(
                f"request {job.req_id}: hicache served {got} of the {len(job.tokens)} tokens "
                "it promised (evicted or L3 unreachable since the lookup); recomputed"
            )
            active.failed = True
        return active

    def _keep_leading(self, active: _ActiveLoad, served_pages: int) -> None:
        """The sidecar served a leading part of what the lookup promised (a page evicted, or
        damaged in L3, since): vLLM keeps the blocks before `served_pages` and recomputes
        from there (`take_errors` names the blocks from there on; vLLM's scheduler cuts the
        request's computed tokens at its first failed block). Only for models whose every
        group keeps every page of a prefix (full or sparse attention): a window's or a
        state's pages for the shorter prefix are not the blocks vLLM allocated. The pages
        this step computes over the stale blocks are not stored (`failed_requests`)."""
        job = active.job
        pages = len(job.tokens) // self.page
        stale: set[int] = set()
        for ids in job.block_ids:
            stale.update(b for b in ids[served_pages:pages] if b != NULL_BLOCK)
        self._errors.update(stale)
        self.failed_requests.add(job.req_id)
        for moves in active.moves.values():  # staging: copy only the pages that were served
            for move in moves:
                pairs = zip(move.pages, move.blocks, strict=True)
                kept = [(p, b) for p, b in pairs if b not in stale]
                move.pages = [p for p, _ in kept]
                move.blocks = [b for _, b in kept]
        self.counters.loads += 1
        self.counters.loads_partial += 1
        self.counters.pages_loaded += served_pages - job.skip_pages
        self.counters.error(
            f"request {job.req_id}: hicache served {served_pages * self.page} of the "
            f"{len(job.tokens)} tokens it promised (evicted or damaged since the lookup); "
            f"vLLM keeps those and recomputes from block {served_pages}"
        )

    def await_unended(self) -> None:
        """Direct loads that had not ended when their step did, waited for before the next
        forward (vLLM reuses their blocks from then on), up to the stores' settle time."""
        if not self._unended:
            return
        deadline = time.monotonic() + self.stores.settle_timeout_s
        for req_id, handle in self._unended:
            try:
                while handle.state() == "running" and time.monotonic() < deadline:
                    time.sleep(self.retry_after_s / 20)
                ended = handle.state() != "running"
            except Exception:  # the connection is gone: its session ends once the load did,
                self.stores.unsettle(handle.epoch)  # which the stores' drain waits for
                ended = True
            if not ended:
                self.counters.loads_unconfirmed += 1
                self.counters.error(
                    f"request {req_id}: its load did not end in {self.stores.settle_timeout_s:g}"
                    " s more; vLLM goes on writing the blocks it named"
                )
        self._unended = []
