"""The worker half of the vLLM connector, without vLLM: executes each step's loads and stores
between vLLM's blocks and the sidecar, through a staging pool the sidecar maps.

Why staging: on CPU vLLM allocates its KV cache as private memory, which the sidecar cannot
map. The worker owns a staging pool in shared memory, laid out as hicache's device pool and
registered with the sidecar; the sidecar moves pages between it and L2 (and L3) exactly as for
any engine, with all of its transactional guarantees, and the worker copies whole blocks
between staging and vLLM's tensors (one memcpy per block and layer). See docs/design.md.

Lifecycle per engine step (vLLM's worker thread, except the copier):
    worker.start_loads(meta.loads)   # start_load_kv: sidecar loads into staging; a copier
                                     # thread moves each layer into vLLM's blocks as it lands
    worker.wait_layer(layer_id)      # wait_for_layer_load, from the forward
    worker.finish_loads()            # wait_for_save: copier joined, handles released
    worker.store(meta.stores)        # wait_for_save: vLLM blocks -> staging -> sidecar (L2 ack)
    worker.take_load_errors()        # get_block_ids_with_load_errors: vLLM recomputes these

Nothing here raises into vLLM: a sidecar that is down, restarted or slow turns loads into
reported load errors (vLLM recomputes) and stores into counted skips; the client reconnects on
a later call. State layers (Mamba, GDN, short conv) get no per-layer hook from vLLM, so
`start_loads` returns only once every state layer has landed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from hicache.client import Client, LoadHandle
from hicache.errors import HicacheError
from hicache.integrations.vllm_binding import LayerBinding, index_tensor
from hicache.integrations.vllm_plan import NULL_BLOCK, LoadJob, StoreJob
from hicache.memory import DevicePool
from hicache.model import LayerMap

log = logging.getLogger("hicache.vllm")


class Staging:
    """Free staging pages per hicache group; page 0 of every group is the scratch page that
    positions vLLM does not need (its own prefix hit, a window it dropped) are loaded into."""

    def __init__(self, num_pages: Mapping[str, int]):
        self.num_pages = dict(num_pages)
        self._free = {g: list(range(n - 1, 0, -1)) for g, n in num_pages.items()}
        self._lock = threading.Lock()  # asynchronous loads give pages back from their threads

    def take(self, wanted: Mapping[str, int]) -> dict[str, list[int]] | None:
        """`wanted[g]` pages of every group at once, or None (nothing taken)."""
        with self._lock:
            if any(len(self._free[g]) < n for g, n in wanted.items()):
                return None
            return {g: [self._free[g].pop() for _ in range(n)] for g, n in wanted.items()}

    def give(self, pages: Mapping[str, Sequence[int]]) -> None:
        with self._lock:
            for g, ids in pages.items():
                self._free[g].extend(ids)


@dataclass
class _Move:
    """One layer's copies for one job: staging pages <-> vLLM block ids."""

    binding: LayerBinding
    pages: torch.Tensor
    blocks: torch.Tensor


@dataclass
class _ActiveLoad:
    job: LoadJob
    handle: LoadHandle | None
    staging: dict[str, list[int]]
    moves: dict[int, list[_Move]]  # layer id -> copies once it lands
    failed: bool = False
    reported: bool = False  # its blocks are in the step's load errors


@dataclass
class WorkerCounters:
    loads: int = 0
    load_failures: int = 0
    pages_loaded: int = 0
    stores: int = 0
    store_failures: int = 0
    stores_skipped_staging: int = 0
    pages_stored: int = 0
    errors: list[str] = field(default_factory=list)

    def error(self, message: str) -> None:
        self.errors = [*self.errors[-19:], message]
        log.warning(message)


class WorkerSide:
    def __init__(
        self,
        layer_map: LayerMap,
        bindings: Mapping[int, LayerBinding],
        connect: Callable[[], Client],
        staging_pages: Mapping[str, int],
        *,
        page_size_tokens: int,
        load_timeout_s: float = 10.0,
        retry_after_s: float = 1.0,
        state_load_block: Callable[[Sequence[int], int], int],
        state_store_block: Callable[[Sequence[int], int], int | None],
    ):
        self.layer_map = layer_map
        self.bindings = dict(bindings)
        self.page = page_size_tokens
        self.load_timeout_s = load_timeout_s
        self.retry_after_s = retry_after_s
        self.staging = Staging(staging_pages)
        self._staging_pages = dict(staging_pages)
        self._connect = connect
        self._client: Client | None = None
        self._pools: dict[str, DevicePool] = {}
        self._next_try = 0.0
        self._down = False
        self._state_load_block = state_load_block
        self._state_store_block = state_store_block
        self._order = [i for i in layer_map.stage_layer_ids if i in self.bindings]
        self._state_layers = [
            i
            for i in self._order
            if not layer_map.group(self.bindings[i].group).kind.is_token_cache
        ]
        self._active: list[_ActiveLoad] = []
        self._landed: dict[int, threading.Event] = {}
        self._copier: threading.Thread | None = None
        self._errors: set[int] = set()
        self._async: dict[str, threading.Thread] = {}
        self._async_done: list[tuple[str, bool]] = []
        self._async_lock = threading.Lock()
        self.counters = WorkerCounters()

    # ---- the sidecar ----------------------------------------------------------------------

    def client(self) -> Client | None:
        """The connected client (made on first use, retried at most every retry_after_s)."""
        if self._client is not None:
            return self._client
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + self.retry_after_s
        try:
            client = self._connect()
            pools = client.create_pools(self._staging_pages)
            client.register_pools(pools)
        except (HicacheError, OSError) as exc:
            if not self._down:  # once per outage, not once per retry
                self.counters.error(f"hicache sidecar not reachable, serving without it: {exc}")
            self._down = True
            return None
        if self._down:
            log.info("hicache sidecar reachable again")
        self._down = False
        self._client = client
        self._pools = pools.device_pools()
        return client

    def close(self) -> None:
        self.finish_loads()
        for thread in list(self._async.values()):
            thread.join(timeout=self.load_timeout_s)
        if self._client is not None:
            self._client.close()
            self._client = None

    # ---- loads -----------------------------------------------------------------------------

    def start_loads(self, jobs: Sequence[LoadJob]) -> None:
        self.finish_loads()  # a step that never reached wait_for_save (should not happen)
        if not jobs:
            return
        client = self.client()
        for job in jobs:
            active = self._start_one(client, job)
            self._active.append(active)
            if active.failed:
                self._fail(active)
        self._landed = {i: threading.Event() for i in self._order}
        self._copier = threading.Thread(target=self._copy_layers, name="hicache-vllm-load")
        self._copier.daemon = True
        self._copier.start()
        for layer_id in self._state_layers:  # no per-layer hook reaches these: wait here
            self.wait_layer(layer_id)

    def start_async_loads(self, jobs: Sequence[LoadJob]) -> None:
        """Loads vLLM waits for between steps (the request sits in WAITING_FOR_REMOTE_KVS):
        each runs on a thread of its own, across steps, and is reported by `take_finished`."""
        if not jobs:
            return
        client = self.client()
        for job in jobs:
            active = self._start_one(client, job)
            thread = threading.Thread(
                target=self._run_async, args=(active,), name=f"hicache-vllm-load-{job.req_id}"
            )
            thread.daemon = True
            self._async[job.req_id] = thread
            thread.start()

    def _run_async(self, active: _ActiveLoad) -> None:
        ok = False
        try:
            if not active.failed and active.handle is not None:
                for layer_id in self._order:
                    active.handle.wait_layer(layer_id, timeout_s=self.load_timeout_s)
                    for move in active.moves.get(layer_id, ()):
                        move.binding.from_staging(
                            self._pools[move.binding.group], move.pages, move.blocks
                        )
                ok = active.handle.done(timeout_s=self.load_timeout_s) == "done"
        except Exception as exc:  # vLLM recomputes the request
            self.counters.error(f"request {active.job.req_id}: load failed: {exc}")
        finally:
            if not ok and active.handle is not None:
                with contextlib.suppress(Exception):
                    active.handle.cancel()
            if not ok:
                self.counters.load_failures += 1
            self.staging.give(active.staging)
            with self._async_lock:
                self._async_done.append((active.job.req_id, ok))

    def take_finished(self) -> tuple[set[str], set[str]]:
        """Asynchronous loads that ended since the last call: (all of them, the failed)."""
        with self._async_lock:
            done, self._async_done = self._async_done, []
        for req_id, _ in done:
            self._async.pop(req_id, None)
        return {r for r, _ in done}, {r for r, ok in done if not ok}

    def _start_one(self, client: Client | None, job: LoadJob) -> _ActiveLoad:
        pages = len(job.tokens) // self.page
        wanted = {
            g.name: (pages - job.skip_pages) if g.kind.is_token_cache else 1
            for g in self.layer_map.groups
        }
        active = _ActiveLoad(job, None, {}, {})
        if client is None:
            active.failed = True
            return active
        staging = self.staging.take(wanted)
        if staging is None:
            self.counters.error(
                f"request {job.req_id}: its load needs {wanted} staging pages, more than are "
                f"free of {self._staging_pages}; recomputed (raise staging_pages)"
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
                pairs = [(staging[binding.group][0], self._state_load_block(ids, pages))]
            if pairs:
                active.moves.setdefault(layer_id, []).append(
                    _Move(
                        binding,
                        index_tensor([p for p, _ in pairs]),
                        index_tensor([b for _, b in pairs]),
                    )
                )
        try:
            if job.from_l3:  # bring L3's pages to L2 first: the load itself waits briefly
                client.prefetch(list(job.tokens))
            handle = client.load(list(job.tokens), device_pages, skip_pages=job.skip_pages)
        except (HicacheError, OSError) as exc:
            self.counters.error(f"request {job.req_id}: load failed to start: {exc}")
            active.failed = True
            return active
        active.handle = handle
        if handle is None or handle.tokens < len(job.tokens):
            got = 0 if handle is None else handle.tokens
            self.counters.error(
                f"request {job.req_id}: hicache served {got} of the {len(job.tokens)} tokens "
                "it promised (evicted or L3 unreachable since the lookup); recomputed"
            )
            active.failed = True
        else:
            self.counters.loads += 1
            self.counters.pages_loaded += pages - job.skip_pages
        return active

    def _copy_layers(self) -> None:
        for layer_id in self._order:
            for active in self._active:
                if active.failed or active.handle is None:
                    continue
                try:
                    active.handle.wait_layer(layer_id, timeout_s=self.load_timeout_s)
                    pool = self._pools
                    for move in active.moves.get(layer_id, ()):
                        move.binding.from_staging(pool[move.binding.group], move.pages, move.blocks)
                except Exception as exc:  # a failed layer: vLLM recomputes the request
                    self.counters.error(f"request {active.job.req_id}: layer {layer_id}: {exc}")
                    active.failed = True
            self._landed[layer_id].set()

    def wait_layer(self, layer_id: int) -> None:
        event = self._landed.get(layer_id)
        if event is None:
            return
        if not event.wait(self.load_timeout_s * max(1, len(self._active))):
            for active in self._active:
                if not event.is_set():
                    active.failed = True
            self.counters.error(f"layer {layer_id} did not land in time; loads recomputed")

    def finish_loads(self) -> None:
        if not self._active:
            return
        if self._copier is not None:
            self._copier.join()
            self._copier = None
        for active in self._active:
            handle = active.handle
            if handle is not None:
                try:
                    if handle.done(timeout_s=self.load_timeout_s) != "done":
                        active.failed = True
                except Exception as exc:
                    self.counters.error(f"request {active.job.req_id}: load end: {exc}")
                    active.failed = True
            if active.failed:
                self._fail(active)
            self.staging.give(active.staging)
        self._active = []
        self._landed = {}

    def _fail(self, active: _ActiveLoad) -> None:
        if active.reported:
            return
        active.reported = True
        self.counters.load_failures += 1
        pages = len(active.job.tokens) // self.page
        for ids in active.job.block_ids:
            self._errors.update(b for b in ids[active.job.skip_pages : pages] if b != NULL_BLOCK)

    def take_load_errors(self) -> set[int]:
        self.finish_loads()
        errors, self._errors = self._errors, set()
        return errors

    # ---- stores ----------------------------------------------------------------------------

    def store(self, jobs: Sequence[StoreJob]) -> None:
        if not jobs:
            return
        client = self.client()
        if client is None:
            self.counters.store_failures += len(jobs)
            return
        for job in jobs:
            self._store_one(client, job)

    def _store_one(self, client: Client, job: StoreJob) -> None:
        full = len(job.tokens) // self.page
        snapshot_blocks: dict[int, int] = {}  # vLLM group -> block holding the state now
        plan: dict[str, list[int]] = {}  # hicache token group -> positions with a block
        for g in self.layer_map.groups:
            layer_ids = [i for i in g.layer_ids if i in self.bindings]
            vgroups = sorted({self.bindings[i].vllm_group for i in layer_ids})
            if g.kind.is_token_cache:
                plan[g.name] = [
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
            and all(
                self.bindings[i].vllm_group in snapshot_blocks
                for i in g.layer_ids
                if i in self.bindings
            )
            and job.computed_after == len(job.tokens)
        ]
        wanted = {g: len(pos) for g, pos in plan.items()} | {g: 1 for g in state_groups}
        staging = self.staging.take(wanted)
        if staging is None:
            self.counters.stores_skipped_staging += 1
            self.counters.error(
                f"request {job.req_id}: its store needs {wanted} staging pages, more than are "
                f"free of {self._staging_pages}; not stored (raise staging_pages)"
            )
            return
        try:
            device_pages: dict[str, list[int | None]] = {}
            for name, positions in plan.items():
                where = dict(zip(positions, staging[name], strict=True))
                device_pages[name] = [where.get(i) for i in range(full)]
            for binding in self.bindings.values():
                pool = self._pools[binding.group]
                if binding.group in plan:
                    positions = plan[binding.group]
                    if not positions:
                        continue
                    ids = job.block_ids[binding.vllm_group]
                    binding.to_staging(
                        pool,
                        index_tensor([ids[i] for i in positions]),
                        index_tensor(staging[binding.group]),
                    )
                elif binding.group in state_groups:
                    binding.to_staging(
                        pool,
                        index_tensor([snapshot_blocks[binding.vllm_group]]),
                        index_tensor(staging[binding.group]),
                    )
            snapshots = {g: {len(job.tokens): staging[g][0]} for g in state_groups}
            client.store(list(job.tokens), device_pages, snapshots)
            self.counters.stores += 1
            self.counters.pages_stored += sum(len(p) for p in plan.values())
        except (HicacheError, OSError) as exc:
            self.counters.store_failures += 1
            self.counters.error(f"request {job.req_id}: store failed: {exc}")
        finally:
            self.staging.give(staging)
