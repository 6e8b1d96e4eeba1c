"""KV events from the connector through vLLM's own event channel: what hicache stored for this
engine, published by vLLM's KV-event publisher (`kv_events_config`) beside vLLM's own GPU
events, so one subscriber of the engine sees hicache's tiers too.

vLLM 0.32's path: after each step the worker's `get_kv_connector_kv_cache_events()` returns a
`KVConnectorKVEvents`; vLLM merges the tensor-parallel workers' (their events concatenated)
and hands them to the scheduler's `update_connector_output`; in the same step's update the
scheduler asks the connector's `take_events()` and publishes them in its batch.

What is reported: `BlockStored` medium `CPU` for the pages a store's reply says L2 holds
(all it named, or the prefix `truncated_to_tokens` left), and `STORAGE` for them when the
reply says L3 holds them (`persisted`, asked for by a `kv_producer` with
`persisted_within_s`). The hashes are vLLM's own (`Request.block_hashes`, carried in the
step's `StoreJob`; nothing recomputed), so they equal vLLM's GPU events for the same blocks,
with `group_idx` vLLM's group. Not reported: removals (the connector is not told of L2
evictions or L3 deletions — the sidecar's publisher, `service.kv_events`, is), and stores of
models with more than one KV-cache group (a hybrid's groups hash at another granularity).

Lifecycle, per engine:
- worker (vLLM's worker thread): `WorkerEvents.answered(job, reply)` per store answered (at
  the drain, or harvested when its reply is there: never waiting) -> events pending, at most
  `limit` (past it dropped and counted: `kv_events_dropped` in the worker's `stats_path`)
  -> `take()` in `get_kv_connector_kv_cache_events` hands them over (None when there are
  none) and starts empty again;
- scheduler (EngineCore): `SchedulerEvents.add(container)` splits them per block and counts
  the reports of each (medium, hash): a block is published once there are as many as
  tensor-parallel ranks (a rank that reports a block twice before another reports it — a
  store repeated after vLLM rolled the request back — counts twice); at most `limit` blocks
  wait (the oldest dropped, counted, said once in the log) -> `take()` in `take_events`
  returns the ready blocks coalesced (consecutive blocks of one
chain in one `BlockStored`) and starts empty again."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from hicache.integrations.vllm.plan import StoreJob

log = logging.getLogger("hicache.vllm")
CPU, STORAGE = "CPU", "STORAGE"
DEFAULT_LIMIT = 65536  # pending events on a worker, waiting blocks on the scheduler


def events_enabled(vllm_config: Any, kv_cache_groups: int) -> bool:
    """vLLM publishes KV events, and this model's blocks are hashed one per hicache page."""
    config = getattr(vllm_config, "kv_events_config", None)
    on = config is not None and bool(getattr(config, "enable_kv_cache_events", False))
    return on and kv_cache_groups == 1


class HicacheKvEvents(KVConnectorKVEvents):
    """One step's events of one worker (vLLM concatenates the ranks' into the first's)."""

    def __init__(self, events: list[KVCacheEvent], num_workers: int = 1):
        self._events = list(events)
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> HicacheKvEvents:
        return self  # the scheduler counts ranks per block (`SchedulerEvents`)

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._events

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []
        self._workers = 1


class WorkerEvents:
    def __init__(self, page_size_tokens: int, vllm_group: int = 0, limit: int = DEFAULT_LIMIT):
        self.page = page_size_tokens
        self.vllm_group = vllm_group
        self.limit = limit
        self._events: list[KVCacheEvent] = []
        self.dropped = 0  # events past `limit` (vLLM took none for that long)

    def answered(self, job: StoreJob, reply: dict[str, Any]) -> None:
        """A store's reply: its pages that L2 (and, when said, L3) holds now."""
        if not job.block_hashes:
            return  # events off, or vLLM had not hashed every page the job stores
        held = len(job.block_hashes)
        cut = reply.get("truncated_to_tokens")
        if cut is not None:
            held = max(0, min(held, int(cut) // self.page - job.first_page))
        if held == 0:
            return
        media = [CPU, STORAGE] if reply.get("persisted") else [CPU]
        start = job.first_page * self.page
        tokens = list(job.tokens[start : start + held * self.page])
        hashes = job.block_hashes[:held]
        for medium in media:
            if len(self._events) >= self.limit:
                self.dropped += 1
                continue
            self._events.append(self._stored(hashes, job.parent_hash, tokens, medium))

    def _stored(
        self, hashes: Sequence[bytes], parent: bytes | None, tokens: list[int], medium: str
    ) -> BlockStored:
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(BlockHash(h)) for h in hashes],
            parent_block_hash=None
            if parent is None
            else maybe_convert_block_hash(BlockHash(parent)),
            token_ids=tokens,
            block_size=self.page,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=self.vllm_group,
        )

    def take(self) -> HicacheKvEvents | None:
        if not self._events:
            return None
        events, self._events = self._events, []
        return HicacheKvEvents(events)


@dataclass(slots=True)
class _Block:
    medium: str
    block_hash: Any
    parent: Any
    tokens: list[int]
    block_size: int
    group_idx: int | None
    ranks: int = 0


class SchedulerEvents:
    def __init__(self, tp_size: int = 1, limit: int = DEFAULT_LIMIT):
        self.tp_size = tp_size
        self.limit = limit
        self._waiting: dict[tuple[str, Any], _Block] = {}  # reported by fewer than tp_size
        self._ready: list[_Block] = []
        self.dropped = 0  # blocks that waited past `limit` for their other ranks

    def add(self, container: KVConnectorKVEvents) -> None:
        for event in container.get_all_events():
            if isinstance(event, BlockStored):
                self._split(event)

    def _split(self, event: BlockStored) -> None:
        size = event.block_size
        parent = event.parent_block_hash
        for i, block_hash in enumerate(event.block_hashes):
            key = (str(event.medium), block_hash)
            block = self._waiting.get(key)
            if block is None:
                tokens = list(event.token_ids[i * size : (i + 1) * size])
                block = _Block(str(event.medium), block_hash, parent, tokens, size, event.group_idx)
                self._waiting[key] = block
            block.ranks += 1
            if block.ranks >= self.tp_size:
                del self._waiting[key]
                self._ready.append(block)
            parent = block_hash
        while len(self._waiting) > self.limit:
            del self._waiting[next(iter(self._waiting))]
            if not self.dropped:
                log.warning(
                    "kv events: more than %d blocks waited for their other tensor-parallel "
                    "ranks; the oldest are dropped (counted), not published",
                    self.limit,
                )
            self.dropped += 1

    def take(self) -> list[KVCacheEvent]:
        """The blocks every rank holds, consecutive ones of a chain in one `BlockStored`."""
        ready, self._ready = self._ready, []
        out: list[BlockStored] = []
        for block in ready:
            last = out[-1] if out else None
            if (
                last is not None
                and (last.medium, last.group_idx) == (block.medium, block.group_idx)
                and last.block_hashes[-1] == block.parent
            ):
                last.block_hashes.append(block.block_hash)
                last.token_ids.extend(block.tokens)
                continue
            out.append(
                BlockStored(
                    block_hashes=[block.block_hash],
                    parent_block_hash=block.parent,
                    token_ids=list(block.tokens),
                    block_size=block.block_size,
                    lora_id=None,
                    medium=block.medium,
                    lora_name=None,
                    group_idx=block.group_idx,
                )
            )
        return list(out)
