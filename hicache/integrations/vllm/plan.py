"""The scheduler half of the vLLM connector, without vLLM: which requests load what, which
pages each engine step stores, and the per-step metadata the worker half executes.

Lifecycle (all in vLLM's EngineCore process, on its scheduler thread):
    book = StepBook(page_size_tokens, lookup, stores=True)  # lookup(tokens) -> (in L2, in all),
                                                   # or None: ask again later (a store writing);
                                                   # stores=False: kv_consumer, loads only
    book.matched(req_id, tokens, local_tokens)     # get_num_new_matched_tokens: side-effect free;
                                                   # None: vLLM asks again at a later step
    book.allocated(req_id, tokens, local, n_ext, block_ids)   # update_state_after_alloc
    meta = book.step(scheduled)                    # build_connector_meta: loads, then stores
    book.finished(req_id)                          # request_finished_all_groups

A vLLM block is a hicache page. Keys are hicache's (chained over token ids, seeded by the
sidecar's model name and the connector's tenant), not vLLM's block hashes, so a vLLM engine
and a `hicache.client` engine serving one model through one sidecar share pages.

Stores happen while a request runs, not when it finishes: each step stores the pages that step
filled (prefill chunks and decode alike), so a page is in hicache before the step that made it
ends, and a sliding group's page is taken while it is still in the window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# vLLM's null block: the id a group lists where it holds no block (out of window, not kept)
NULL_BLOCK = 0


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Load `tokens` (whole pages) into vLLM's blocks; the first `skip_pages` are vLLM's own
    prefix-cache hit. `block_ids[g]` are group g's blocks in token order (vLLM's groups)."""

    req_id: str
    tokens: tuple[int, ...]
    skip_pages: int
    block_ids: tuple[tuple[int, ...], ...]
    from_l3: bool = False  # part of the hit was only in L3 at lookup: fetch it first


@dataclass(frozen=True, slots=True)
class StoreJob:
    """Store `tokens` (whole pages); pages before `first_page` were stored already (or loaded),
    so only [first_page, len(tokens) // page) move. `block_ids` as in `LoadJob`."""

    req_id: str
    tokens: tuple[int, ...]
    first_page: int
    block_ids: tuple[tuple[int, ...], ...]
    # tokens with KV after the step (unclipped): a state group's snapshot is taken when it
    # equals len(tokens) (the step ended on a page boundary), since its block holds the
    # state after exactly that many tokens then
    computed_after: int = 0
    # KV events on (`vllm/kv_events.py`): vLLM's own block hashes of the pages this job
    # stores ([first_page, len(tokens) // page)) and of the page before them; else empty
    block_hashes: tuple[bytes, ...] = ()
    parent_hash: bytes | None = None
    # the first store to reach the prompt's last whole page (the prefill's last chunk, or
    # the one before it when that chunk adds no whole page): a producer asks L3 for it
    # alone (`persisted_within_s`), its pages and every earlier chunk's then in L3
    completes_prompt: bool = False


@dataclass(slots=True)
class StepMeta:
    """What one engine step's worker must do: loads before the forward, stores after it."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One request in a step: its tokens so far, how many had KV before the step, how many
    the step computes, and its blocks per group now."""

    req_id: str
    tokens: Sequence[int]
    computed_before: int
    num_scheduled: int
    block_ids: Sequence[Sequence[int]]
    # vLLM's block hashes of the request (`Request.block_hashes`) when KV events are on
    block_hashes: Sequence[bytes] = ()
    prompt_tokens: int = 0  # the request's prompt length (0: unknown, no store completes it)


class StepBook:
    def __init__(
        self,
        page_size_tokens: int,
        lookup: Callable[[Sequence[int]], tuple[int, int] | None],
        *,
        async_loads: bool = False,
        stores: bool = True,
    ):
        self.page = page_size_tokens
        # asynchronous loads run between steps: vLLM schedules the request only once its load
        # ended, so a load goes out in the step after its allocation, scheduled or not
        self.async_loads = async_loads
        # False: a decode instance (kv_consumer) never stores; its steps carry loads only
        self.stores = stores
        self._lookup = lookup
        self._loads: dict[str, LoadJob] = {}
        self._stored_pages: dict[str, int] = {}  # per running request: pages hicache has
        self._l2_tokens: dict[str, int] = {}  # per matched request: of its hit, in L2
        # per matched request, until its next scheduled step: the whole pages hicache held at
        # its latest lookup. vLLM's own prefix hit may reach further (hicache evicted those
        # pages, restarted, or never saw them); those pages are stored from vLLM's blocks,
        # or every later page of the request is unreachable (a lookup stops at a gap)
        self._held_pages: dict[str, int] = {}
        self._after: dict[str, int] = {}  # per running request: tokens with KV after its step
        self.lookups = 0
        self.hit_tokens = 0

    def matched(self, req_id: str, tokens: Sequence[int], local_tokens: int) -> int | None:
        """Tokens beyond vLLM's own (page-aligned) hit that hicache can load; None: not
        known yet (a store in flight is writing the next page), ask again later. The last
        token is always computed (its logits are the first output), so at most len - 1
        tokens are asked about, rounded down to whole pages by the lookup."""
        if len(tokens) <= self.page:
            return 0
        answer = self._lookup(tokens[: len(tokens) - 1])
        if answer is None:
            return None
        self.lookups += 1
        in_l2, hit = answer
        hit -= hit % self.page
        self._l2_tokens[req_id] = in_l2
        self._held_pages[req_id] = hit // self.page
        return max(0, hit - local_tokens)

    def allocated(
        self,
        req_id: str,
        tokens: Sequence[int],
        local_tokens: int,
        external_tokens: int,
        block_ids: Sequence[Sequence[int]],
    ) -> None:
        """vLLM gave the request its blocks; a load is planned when it took hicache's hit."""
        if external_tokens <= 0:
            return
        total = local_tokens + external_tokens
        pages = total // self.page
        self.hit_tokens += external_tokens
        self._loads[req_id] = LoadJob(
            req_id,
            tuple(tokens[: pages * self.page]),
            local_tokens // self.page,
            tuple(tuple(ids[:pages]) for ids in block_ids),
            from_l3=self._l2_tokens.pop(req_id, 0) < total,
        )

    def step(self, scheduled: Sequence[Scheduled]) -> StepMeta:
        """The step's loads (taken once) and the pages it fills, per request."""
        meta = StepMeta()
        if self.async_loads:
            meta.loads, self._loads = list(self._loads.values()), {}
        for req in scheduled:
            load = None if self.async_loads else self._loads.pop(req.req_id, None)
            if load is not None:
                meta.loads.append(load)
            done = req.computed_before // self.page
            # hicache's whole pages at the lookup before this step, if vLLM asked for one
            looked_up = self._held_pages.pop(req.req_id, None)
            if req.req_id not in self._after:
                # its first step: of vLLM's own prefix hit (the first `done` pages) hicache
                # holds only what the lookup found (nothing known without one)
                have = min(done, looked_up or 0)
            elif req.computed_before < self._after[req.req_id]:
                # vLLM rolled the request back (a failed load, a preemption): what the last
                # steps computed is being recomputed, and is stored again as it is
                have = done if looked_up is None else min(done, looked_up)
            else:
                # pages hicache holds already: a load's, or what earlier steps stored
                have = max(done, self._stored_pages.get(req.req_id, 0))
            if load is not None:
                have = max(have, len(load.tokens) // self.page)
            # unclipped: a state's snapshot is taken only when exactly this many tokens are in
            # it (speculative drafts or placeholders past the known tokens never qualify)
            after = req.computed_before + req.num_scheduled
            full = min(after, len(req.tokens)) // self.page
            self._after[req.req_id] = after
            self._stored_pages[req.req_id] = max(have, full)
            if full > have and self.stores:
                hashes = req.block_hashes
                named = len(hashes) >= full  # vLLM hashed every page stored (one per block)
                meta.stores.append(
                    StoreJob(
                        req.req_id,
                        tuple(req.tokens[: full * self.page]),
                        have,
                        tuple(tuple(ids) for ids in req.block_ids),
                        after,
                        block_hashes=tuple(hashes[have:full]) if named else (),
                        parent_hash=hashes[have - 1] if named and have else None,
                        completes_prompt=have < req.prompt_tokens // self.page <= full,
                    )
                )
        return meta

    def finished(self, req_id: str) -> None:
        self._loads.pop(req_id, None)
        self._l2_tokens.pop(req_id, None)
        self._held_pages.pop(req_id, None)
        self._after.pop(req_id, None)
        self._stored_pages.pop(req_id, None)
