"""The worker half of the vLLM connector, without vLLM: its sidecar client, and each step's
loads (`vllm/loads.py`) and stores (`vllm/stores.py`) between vLLM's blocks and the sidecar.

Direct (the default where it can be: CPU with vLLM's KV memory shared in place, or CUDA by
IPC handle; `vllm/shared_kv.py`): vLLM's blocks are the pool the sidecar maps, page ids are
vLLM's block ids, and the sidecar's copies (L2 -> blocks for a load, blocks -> L2 for a store)
are the only ones, made in its own process. Staging (the fallback: another allocator, or a
hicache group whose layers span several vLLM KV-cache groups, each with its own block ids):
the worker owns a staging pool laid out as hicache's device pool, the sidecar moves pages
between it and L2, and the worker copies whole blocks between staging and vLLM's tensors on
vLLM's thread. Either way every transactional guarantee of the sidecar holds unchanged. See
docs/design.md.

Lifecycle per engine step (all on vLLM's worker thread):
    worker.before_forward()          # handle_preemptions: stores of earlier steps answered,
                                     # loads that overran ended, before vLLM writes blocks
    worker.start_loads(meta.loads)   # start_load_kv: the sidecar loads (blocks or staging)
    worker.wait_layer(layer_id)      # wait_for_layer_load, from the forward: the layer landed
                                     # (staging: then copied into vLLM's blocks)
    worker.finish_loads()            # wait_for_save: loads ended, handles released
    worker.store(meta.stores)        # wait_for_save: direct: sent, not waited for; staging:
                                     # blocks -> staging -> sidecar (L2 ack)
    worker.await_stores()            # kv_producer, wait_for_save: every reply in (L2 holds
                                     # the step's pages when the step ends)
    worker.take_load_errors()        # get_block_ids_with_load_errors: vLLM recomputes these
    worker.start_async_loads(...)    # multi-group models: loads between steps, and
    worker.poll_async()              # get_transfer_results: those that ended (staging: copied)

Nothing here raises into vLLM: a sidecar that is down, restarted or slow turns loads into
reported load errors (vLLM recomputes) and stores into counted skips; the client reconnects on
a later call. State layers (Mamba, GDN, short conv) get no per-layer hook from vLLM, so
`start_loads` returns only once every state layer has landed (hybrids load asynchronously
anyway: vLLM maps a failed load back to its request only with one KV-cache group).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hicache.channel import protocol as p
from hicache.client import Client, ClientError
from hicache.errors import HicacheError
from hicache.integrations.vllm.binding import LayerBinding
from hicache.integrations.vllm.loads import Loads
from hicache.integrations.vllm.plan import LoadJob, StoreJob
from hicache.integrations.vllm.staging import Staging, WorkerCounters
from hicache.integrations.vllm.stores import Stores
from hicache.memory import DevicePool
from hicache.model import LayerMap

log = logging.getLogger("hicache.vllm")


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
        register: Callable[[Client], None] | None = None,
        stream: Callable[[], Any] = lambda: None,
        persisted_within_s: float = 0.0,
        on_answered: Callable[[StoreJob, dict[str, Any]], None] | None = None,
    ):
        """`register`: registers vLLM's own blocks with a new client (direct); None: the
        worker registers a staging pool of `staging_pages` per group instead.
        `stream`: CUDA, vLLM's current stream (the fence of a store, and of a direct load:
        its copies wait for vLLM's zeroing of the blocks it allocated); CPU, None."""
        self.layer_map = layer_map
        self.bindings = dict(bindings)
        self.retry_after_s = retry_after_s
        self.direct = register is not None
        self._register = register
        self.staging = Staging({} if self.direct else staging_pages)
        self._staging_pages = {} if self.direct else dict(staging_pages)
        self._connect = connect
        self._client: Client | None = None
        self._pools: dict[str, DevicePool] = {}
        self._next_try = 0.0
        self._down = False  # since the last failed try: unreachable, or refused `busy`
        self._busy = False
        self.counters = WorkerCounters(data_plane="direct" if self.direct else "staging")
        self.stores = Stores(
            layer_map,
            bindings,
            self.counters,
            state_store_block,
            page_size_tokens=page_size_tokens,
            staging=None if self.direct else self.staging,
            pools=lambda: self._pools,
            stream=stream,
            settle_timeout_s=6 * load_timeout_s,
            retry_after_s=retry_after_s,
            persisted_within_s=persisted_within_s,
            on_answered=on_answered,
        )
        self.loads = Loads(
            layer_map,
            bindings,
            self.counters,
            self.stores,
            self.staging,
            self._staging_pages,
            lambda: self._pools,
            direct=self.direct,
            page_size_tokens=page_size_tokens,
            load_timeout_s=load_timeout_s,
            retry_after_s=retry_after_s,
            state_load_block=state_load_block,
            stream=stream,
        )

    # ---- the sidecar ----------------------------------------------------------------------

    def client(self) -> Client | None:
        """The connected client (made on first use, retried at most every retry_after_s)."""
        if self._client is not None:
            return self._client
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + self.retry_after_s
        client = None
        try:
            client = self._connect()
            if self._register is not None:
                self._register(client)
            else:
                # sized for a full batch of loads, mostly never touched: pages on first use
                pools = client.create_pools(self._staging_pages, prefault=False)
                client.register_pools(pools)
        except (HicacheError, OSError) as exc:
            if client is not None:  # hello went through: end that session, drop the file
                with contextlib.suppress(Exception):
                    client.close()
            busy = isinstance(exc, ClientError) and exc.code == p.ErrorCode.BUSY
            if isinstance(exc, ClientError) and exc.code == p.ErrorCode.REFUSED:  # not an outage
                log.error("hicache sidecar refused this engine, serving without it: %s", exc)
            elif busy:  # the claim rule: an earlier session of this process holds the memory
                self.counters.registrations_busy += 1
                if not self._busy:  # once per run of refusals, not once per retry
                    self.counters.error(
                        "hicache sidecar refused to register this engine's memory yet (an "
                        "earlier session of this process still holds it; not an outage), "
                        f"serving without it and retrying every {self.retry_after_s:g} s: {exc}"
                    )
            elif not self._down or self._busy:  # once per outage, not once per retry
                self.counters.error(f"hicache sidecar not reachable, serving without it: {exc}")
            self._down, self._busy = True, busy
            return None
        if self._down:
            log.info(
                "hicache sidecar %s", "registered this engine" if self._busy else "reachable again"
            )
        self._down = self._busy = False
        self._client = client
        if self._register is None:
            self._pools = pools.device_pools()
        return client

    def before_forward(self) -> None:
        """vLLM's `handle_preemptions`, before this step's forward (and any zeroing or reuse of
        a freed block): every overrun load ended, every earlier store answered, and every op
        that got no reply confirmed over by the sidecar (its session's end); staging pages
        such ops named are free again once theirs is."""
        self.loads.await_unended()  # first: a load lost with its connection is settled below
        self.stores.drain(self._client)
        if self._client is not None:
            self.counters.staging_reclaimed += self.staging.reclaim(self._client.confirmed)

    def close(self) -> None:
        self.finish_loads()
        self.stores.drain(self._client)
        self.stores.close()
        self.loads.cancel_async()
        if self._client is not None:
            self._client.close()
            self._client = None

    # ---- loads (`vllm/loads.py`) -------------------------------------------------------------

    def start_loads(self, jobs: Sequence[LoadJob], *, whole: bool = False) -> None:
        """Synchronous loads of this step (vLLM waits for them inside the forward)."""
        self.loads.start(self.client() if jobs else None, jobs, whole=whole)

    def wait_layer(self, layer_id: int) -> None:
        self.loads.wait_layer(layer_id)

    def finish_loads(self) -> None:
        self.loads.finish()

    def take_load_errors(self) -> set[int]:
        return self.loads.take_errors()

    def start_async_loads(self, jobs: Sequence[LoadJob]) -> None:
        self.loads.start_async(self.client() if jobs else None, jobs)

    def poll_async(self) -> tuple[set[str], set[str]]:
        return self.loads.poll_async()

    # ---- stores ----------------------------------------------------------------------------

    def await_stores(self) -> None:
        """kv_producer, at the end of `wait_for_save`: every store sent so far answered, so
        the step (and a request's response) ends with its pages in L2 (`stores_in_l2`)."""
        started = time.perf_counter()
        self.stores.drain(self._client)
        self.counters.store_ack_wait_s += time.perf_counter() - started

    def harvest_stores(self) -> None:
        """The stores answered by now, without waiting (KV events report them this step)."""
        self.stores.harvest(self._client)

    def store(self, jobs: Sequence[StoreJob]) -> None:
        """The step's stores, after `finish_loads`; then the step's failed loads are
        forgotten (vLLM recomputes those requests from the failed block on)."""
        failed = self.loads.failed_requests
        try:
            self.stores.submit(self.client() if jobs else None, jobs, failed)
        finally:
            failed.clear()
