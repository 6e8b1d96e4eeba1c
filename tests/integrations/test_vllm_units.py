"""The vLLM connector's parts that need no vLLM: the scheduler-side step book, the layer
binding and its errors, the staging pages, the worker half against a fake sidecar client
(stores and loads through staging), and the extra-config checks."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.channel.shm import SharedPools
from hicache.client import ClientError, NoReplyError, connect
from hicache.client.handle import Epoch
from hicache.client.process import SidecarProcess
from hicache.errors import ConfigError, PoolShapeError
from hicache.integrations.vllm.binding import StateSpec, bind_layers
from hicache.integrations.vllm.layout import state_load_block, state_store_block
from hicache.integrations.vllm.plan import LoadJob, Scheduled, StepBook, StoreJob
from hicache.integrations.vllm.settings import ConnectorSettings
from hicache.integrations.vllm.staging import Staging
from hicache.integrations.vllm.worker import WorkerSide
from hicache.memory import CacheDtypes, GroupGeometry
from hicache.model import LayerMap, load_layout
from tests.conftest import shared_model

P = 4  # page size in these tests


def book(hit: int = 0, in_l2: int | None = None, **kwargs: bool) -> tuple[StepBook, list[int]]:
    asked: list[int] = []

    def lookup(tokens: list[int]) -> tuple[int, int]:
        asked.append(len(tokens))
        return (hit if in_l2 is None else in_l2), hit

    return StepBook(P, lookup, **kwargs), asked  # type: ignore[arg-type]


def test_matched_never_claims_the_last_token_and_subtracts_vllms_own_hit() -> None:
    b, asked = book(hit=12)
    assert b.matched("r", list(range(13)), 0) == 12
    assert asked == [12]  # the last token is vLLM's to compute
    assert b.matched("r", list(range(13)), 8) == 4  # vLLM holds the first two pages
    assert b.matched("r", list(range(13)), 12) == 0
    assert b.matched("r", list(range(4)), 0) == 0  # one page or less: nothing to ask


def test_a_layerwise_load_goes_out_in_the_step_that_schedules_it() -> None:
    b, _ = book(hit=8)
    b.matched("r", list(range(10)), 0)
    b.allocated("r", list(range(10)), 0, 8, [[5, 6, 7]])
    meta = b.step([Scheduled("r", list(range(10)), 8, 2, [[5, 6, 7]])])
    [load] = meta.loads
    assert (load.tokens, load.skip_pages, load.block_ids, load.from_l3) == (
        tuple(range(8)),
        0,
        ((5, 6),),
        False,
    )
    assert meta.stores == []  # 10 tokens: the third page is not full
    assert b.step([Scheduled("r", list(range(11)), 10, 1, [[5, 6, 7]])]).loads == []


def test_an_async_load_goes_out_in_the_next_step_scheduled_or_not() -> None:
    b, _ = book(hit=8, in_l2=4, async_loads=True)
    b.matched("r", list(range(10)), 0)
    b.allocated("r", list(range(10)), 0, 8, [[5, 6, 7]])
    [load] = b.step([]).loads
    assert load.from_l3  # half the hit was only in L3 at lookup
    assert b.step([]).loads == []


def test_each_step_stores_the_pages_it_filled() -> None:
    b, _ = book()
    tokens = list(range(20))
    first = b.step([Scheduled("r", tokens[:10], 0, 10, [[1, 2, 3]])])
    [store] = first.stores
    assert (store.tokens, store.first_page, store.computed_after) == (tuple(range(8)), 0, 10)
    assert b.step([Scheduled("r", tokens[:11], 10, 1, [[1, 2, 3]])]).stores == []
    [decode] = b.step([Scheduled("r", tokens[:12], 11, 1, [[1, 2, 3]])]).stores
    assert (decode.first_page, len(decode.tokens), decode.computed_after) == (2, 12, 12)
    # preempted and recomputed from scratch: stored again (the sidecar keeps what it has)
    [again] = b.step([Scheduled("r", tokens[:12], 0, 12, [[4, 5, 6]])]).stores
    assert again.first_page == 0
    b.finished("r")


def test_a_loaded_prefix_is_not_stored_again() -> None:
    b, _ = book(hit=8)
    b.matched("r", list(range(13)), 0)
    b.allocated("r", list(range(13)), 0, 8, [[5, 6, 7, 8]])
    meta = b.step([Scheduled("r", list(range(13)), 8, 5, [[5, 6, 7, 8]])])
    [store] = meta.stores
    assert store.first_page == 2
    assert len(store.tokens) == 12


def test_vllms_own_prefix_hit_is_stored_where_hicache_lacks_it() -> None:
    """vLLM served two pages from its own cache; hicache holds only the first (evicted,
    restarted, or another instance's L2 never had them). The first step stores from page 1:
    otherwise page 1 is never in hicache and no later page of the prompt can ever hit (a
    lookup stops at the first missing page)."""
    b, _ = book(hit=4)
    assert b.matched("r", list(range(13)), 8) == 0  # nothing beyond vLLM's own hit
    [store] = b.step([Scheduled("r", list(range(13)), 8, 5, [[5, 6, 7, 8]])]).stores
    assert (store.first_page, len(store.tokens)) == (1, 12)
    # without a lookup (vLLM never asked: nothing known) the whole prefix goes
    b2, _ = book()
    [store] = b2.step([Scheduled("s", list(range(13)), 8, 5, [[5, 6, 7, 8]])]).stores
    assert store.first_page == 0
    # hicache holding all of vLLM's hit: only the new page
    b3, _ = book(hit=8)
    b3.matched("t", list(range(13)), 8)
    [store] = b3.step([Scheduled("t", list(range(13)), 8, 5, [[5, 6, 7, 8]])]).stores
    assert store.first_page == 2


def _geometries(layer_map: LayerMap) -> dict[str, GroupGeometry]:
    dtypes = CacheDtypes.from_names("bfloat16", None, None)
    return {g.name: GroupGeometry.of(g, dtypes, 16) for g in layer_map.groups}


def _llama() -> tuple[LayerMap, dict[str, GroupGeometry]]:
    layer_map = LayerMap(load_layout(shared_model("llama-3.1-8b.json")))
    return layer_map, _geometries(layer_map)


def _vllm_caches(layer_map: LayerMap, blocks: int = 3) -> dict[str, torch.Tensor]:
    """vLLM's attention tensors: `[blocks, kv_heads, block_size, 2 * head]`, one per layer."""
    spec = layer_map.groups[0].spec
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(
            blocks, spec.num_kv_heads, 16, 2 * spec.head_dim, dtype=torch.bfloat16
        )
        for i in layer_map.stage_layer_ids
    }


def _index(caches: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: int(name.split(".")[2]) for name in caches}


def test_every_layer_is_bound_to_its_own_tensor() -> None:
    layer_map, geometries = _llama()
    caches = _vllm_caches(layer_map)
    bound = bind_layers(layer_map, geometries, caches, _index(caches), dict.fromkeys(caches, 0), {})
    for layer_id, binding in bound.items():
        tensor = caches[f"model.layers.{layer_id}.self_attn.attn"]
        assert binding.blocks.data_ptr() == tensor.data_ptr(), layer_id
        binding.blocks[1].fill_(layer_id + 1)  # writes land in vLLM's block of that layer
        assert tensor[1].view(torch.uint8).unique().tolist() == [layer_id + 1]


def test_a_block_hicache_would_size_differently_is_refused_by_name() -> None:
    layer_map, geometries = _llama()
    caches = _vllm_caches(layer_map)
    caches["model.layers.3.self_attn.attn"] = torch.zeros(3, 8, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(
        PoolShapeError,
        match=r"^layer 3 \('model.layers.3.self_attn.attn', hicache group 'full'\): a vLLM block is 16384 bytes \(tensor \(3, 8, 16, 64\) torch.bfloat16\); hicache's page of this layer is 65536 bytes",
    ):
        bind_layers(layer_map, geometries, caches, _index(caches), dict.fromkeys(caches, 0), {})


def test_a_layer_vllm_does_not_give_is_named() -> None:
    layer_map, geometries = _llama()
    caches = _vllm_caches(layer_map)
    del caches["model.layers.7.self_attn.attn"]
    with pytest.raises(
        PoolShapeError, match=r"^layer 7 \(.*\) has no KV tensor in vLLM's register_kv_caches"
    ):
        bind_layers(layer_map, geometries, caches, _index(caches), dict.fromkeys(caches, 0), {})


def test_state_geometry_is_checked_against_vllms_mamba_spec() -> None:
    """LFM2's conv state: hicache's element count must be vLLM's (L_cache - 1) x hidden."""
    layer_map = LayerMap(load_layout(shared_model("lfm2_350m.json")))
    geometries = _geometries(layer_map)
    conv = layer_map.group("conv")
    full = layer_map.group("full")
    ((_, conv_shape),) = geometries["conv"].tensors
    hidden = max(conv_shape)
    caches: dict[str, torch.Tensor] = {}
    specs: dict[str, StateSpec] = {}
    groups: dict[str, int] = {}
    for i in conv.layer_ids:
        name = f"model.layers.{i}.conv"
        caches[name] = torch.zeros(3, 1, 1, 4 * hidden, dtype=torch.int8)
        specs[name] = StateSpec(((3, hidden),), (torch.bfloat16,))  # L_cache, not L_cache - 1
        groups[name] = 0
    for i in full.layer_ids:
        name = f"model.layers.{i}.self_attn.attn"
        caches[name] = torch.zeros(
            3, full.spec.num_kv_heads, 16, 2 * full.spec.head_dim, dtype=torch.bfloat16
        )
        groups[name] = 1
    with pytest.raises(
        PoolShapeError,
        match=rf"^layer {conv.layer_ids[0]} \(.*\): vLLM's state tensors are \(3, {hidden}\) bfloat16; hicache's geometry for this family is conv {2 * hidden} x bfloat16",
    ):
        bind_layers(layer_map, geometries, caches, _index(caches), groups, specs)
    for name in specs:
        specs[name] = StateSpec(((2, hidden),), (torch.bfloat16,))
    bound = bind_layers(layer_map, geometries, caches, _index(caches), groups, specs)
    # the padded page is cut to the state's bytes: padding is never copied
    assert bound[conv.layer_ids[0]].blocks.shape == (3, 2 * hidden * 2)


def test_staging_takes_all_or_nothing_and_never_hands_out_the_scratch_page() -> None:
    staging = Staging({"full": 4, "conv": 2})
    got = staging.take({"full": 3, "conv": 1})
    assert got == {"full": [1, 2, 3], "conv": [1]}
    assert staging.take({"full": 1}) is None  # page 0 is the scratch page
    staging.give(got)
    assert staging.take({"full": 3, "conv": 2}) is None
    assert staging.take({"full": 3, "conv": 1}) is not None


class _Handle:
    """A load the fake sidecar accepted: every layer landed, ended `done`."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self.ended = False

    def wait_layer(self, layer_id: int, timeout_s: float) -> None:
        return None

    def done(self, timeout_s: float) -> str:
        self.ended = True
        return "done"

    def state(self) -> str:
        return "done"

    def cancel(self) -> None:
        return None


class _FakeClient:
    """The sidecar client the worker half uses, recording what it was asked; `store_error`
    is raised by the next stores."""

    def __init__(self, geometries: Mapping[str, GroupGeometry]):
        self.geometries = dict(geometries)
        self.stores: list[dict[str, list[int | None]]] = []
        self.loads: list[dict[str, list[int]]] = []
        self.load_streams: list[object] = []
        self.store_error: Exception | None = None
        self.loads_starved = 0
        self.stats_calls = 0
        self.stats_refusals = 0
        self.store_gate: threading.Event | None = None  # a store waits for it, when set
        self.store_entered = threading.Event()
        self.stores_finished = 0
        self.fences_recorded: list[tuple[object, int]] = []  # (stream, thread id)
        self.store_fences: list[tuple[Any, bytes | None] | None] = []
        self.load_error: Exception | None = None
        self.load_serves: int | None = None  # tokens a load serves (None: all it is asked)
        self.session = 1  # the session said hello in now
        self.registered = 1  # the latest session the memory was registered in

    def record_fence(self, stream: Any = None, op: str = "store") -> tuple[Any, bytes | None]:
        self.fences_recorded.append((stream, threading.get_ident()))
        return (f"event {len(self.fences_recorded)}", None)

    def now(self) -> Epoch:
        return Epoch(None, self.session)

    def confirmed(self, epoch: Epoch) -> bool:
        return self.registered > epoch.session

    def create_pools(self, num_pages: Mapping[str, int], *, prefault: bool = True) -> SharedPools:
        self.staging_prefaulted = prefault
        return SharedPools.create(self.geometries, num_pages, prefault=prefault)

    def register_pools(self, pools: SharedPools) -> None:
        return None

    def store(
        self,
        tokens: Sequence[int],
        device_pages: Mapping[str, Sequence[int | None]],
        snapshots: Mapping[str, Mapping[int, int]] | None = None,
        stream: Any = None,
        fence: tuple[Any, bytes | None] | None = None,
        persisted_within_s: float = 0.0,
    ) -> dict[str, Any]:
        self.store_fences.append(fence)
        self.stores.append({g: list(p) for g, p in device_pages.items()})
        self.store_entered.set()
        if self.store_gate is not None:
            self.store_gate.wait()
        if self.store_error is not None:
            raise self.store_error
        self.stores_finished += 1
        return {}

    def load(
        self,
        tokens: Sequence[int],
        device_pages: Mapping[str, Sequence[int]],
        skip_pages: int,
        *,
        stream: object = None,
    ) -> _Handle:
        self.loads.append({g: list(p) for g, p in device_pages.items()})
        self.load_streams.append(stream)
        if self.load_error is not None:
            raise self.load_error
        return _Handle(len(tokens) if self.load_serves is None else self.load_serves)

    def prefetch(self, tokens: Sequence[int]) -> int:
        return 0

    def starved(self, loads: int = 1) -> None:
        self.loads_starved += loads

    def stats(self) -> dict[str, Any]:
        self.stats_calls += 1
        if self.stats_refusals:
            self.stats_refusals -= 1
            raise ClientError(
                "busy", "register_pools: this memory is still registered by session 1"
            )
        self.session += 1  # the call reconnected, and the memory was registered again
        self.registered = self.session
        return {}

    def close(self) -> None:
        return None


def _worker(
    staging_pages: int, blocks: int = 8, direct: bool = False
) -> tuple[WorkerSide, _FakeClient]:
    layer_map, geometries = _llama()
    caches = _vllm_caches(layer_map, blocks)
    bound = bind_layers(layer_map, geometries, caches, _index(caches), dict.fromkeys(caches, 0), {})
    client = _FakeClient(geometries)
    worker = WorkerSide(
        layer_map,
        bound,
        lambda: client,  # type: ignore[arg-type,return-value]
        {"full": staging_pages},
        page_size_tokens=16,
        retry_after_s=0.01,
        state_load_block=state_load_block,
        state_store_block=state_store_block,
        register=(lambda c: None) if direct else None,
    )
    return worker, client


def test_a_busy_registration_is_counted_and_said_as_a_refusal_not_an_outage() -> None:
    """The sidecar refuses `busy` a registration of memory an unended session of this
    process still holds (service/claims.py): the worker says so once, naming that session,
    counts every refusal, serves without the sidecar and retries as for an outage."""
    layer_map, geometries = _llama()
    caches = _vllm_caches(layer_map, 8)
    bound = bind_layers(layer_map, geometries, caches, _index(caches), dict.fromkeys(caches, 0), {})
    client = _FakeClient(geometries)
    outcomes: list[Exception | None] = [
        ClientError(
            "busy",
            "register_cuda_pools: this memory is still registered by session 3 (engine "
            "'vllm', pid 42), which has 1 request(s) in flight and 0 load(s) running",
        ),
        ClientError("busy", "register_cuda_pools: this memory is still registered by session 3"),
        ConnectionRefusedError("connection refused"),
        None,
    ]

    def register(c: object) -> None:
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    worker = WorkerSide(
        layer_map,
        bound,
        lambda: client,  # type: ignore[arg-type,return-value]
        {"full": 4},
        page_size_tokens=16,
        retry_after_s=1.5,
        state_load_block=state_load_block,
        state_store_block=state_store_block,
        register=register,
    )
    got = []
    for _ in range(4):
        worker._next_try = 0.0  # the next try is due (the test does not wait retry_after_s)
        got.append(worker.client())
    assert got == [None, None, None, client]
    assert worker.counters.registrations_busy == 2
    refusal, outage = worker.counters.errors
    assert refusal.startswith(
        "hicache sidecar refused to register this engine's memory yet (an earlier session of "
        "this process still holds it; not an outage), serving without it and retrying every "
        "1.5 s: busy: register_cuda_pools: this memory is still registered by session 3 "
    )
    assert "not reachable" not in refusal
    assert outage == "hicache sidecar not reachable, serving without it: connection refused"


def test_direct_loads_and_stores_name_vllms_blocks_and_copy_nothing() -> None:
    worker, client = _worker(staging_pages=4, direct=True)
    worker.start_loads([LoadJob("a", tuple(range(48)), 1, ((5, 6, 7, 0),))])
    worker.wait_layer(max(worker.bindings))
    worker.finish_loads()
    assert client.loads == [{"full": [5, 6, 7]}]  # block ids, the skipped one included
    worker.store([StoreJob("a", tuple(range(64)), 3, ((5, 6, 7, 2),), 64)])
    worker.before_forward()
    assert client.stores == [{"full": [None, None, None, 2]}]
    assert worker.counters.load_copy_s == 0
    assert worker.counters.data_plane == "direct"
    assert worker.counters.stores == 1


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staging"])
def test_a_load_served_short_keeps_the_leading_pages_and_recomputes_the_rest(
    direct: bool,
) -> None:
    """Issue #32: a page evicted (or damaged in L3) since the lookup makes the sidecar serve a
    leading part. vLLM is told only the blocks from there on (its scheduler cuts the request's
    computed tokens at the first one), not the whole load, which made it recompute from
    block 0; the request's pages this step are not stored (computed over stale blocks)."""
    worker, client = _worker(staging_pages=8, direct=direct)
    client.load_serves = 32  # 2 of the 4 pages asked for: page 2 went since the lookup
    worker.start_loads([LoadJob("a", tuple(range(64)), 0, ((5, 6, 7, 3),))])
    worker.wait_layer(max(worker.bindings))
    worker.finish_loads()
    assert worker.take_load_errors() == {7, 3}
    counters = worker.counters
    assert (counters.loads, counters.loads_partial, counters.pages_loaded) == (1, 1, 2)
    assert counters.load_failures == 0
    assert worker.counters.errors == [
        "request a: hicache served 32 of the 64 tokens it promised (evicted or damaged since "
        "the lookup); vLLM keeps those and recomputes from block 2"
    ]
    worker.store([StoreJob("a", tuple(range(64)), 0, ((5, 6, 7, 3),), 64)])
    worker.before_forward()
    assert client.stores == []  # computed over the stale blocks: not stored
    client.load_serves = 16  # no more than the pages vLLM had already: nothing kept
    worker.start_loads([LoadJob("b", tuple(range(48)), 1, ((1, 2, 4),))])
    worker.wait_layer(max(worker.bindings))
    worker.finish_loads()
    assert worker.take_load_errors() == {2, 4}
    assert worker.counters.load_failures == 1


def test_a_direct_stores_fence_is_recorded_on_vllms_thread_at_the_hook() -> None:
    """Issue #36, finding 8: the store goes out from the store thread, but its fence must
    mark vLLM's stream as it is at the hook, on vLLM's thread, not later on the store
    thread (where it would also cover kernels vLLM queued after the hook)."""
    layer_map, geometries = _llama()
    caches = _vllm_caches(layer_map, 8)
    bound = bind_layers(layer_map, geometries, caches, _index(caches), dict.fromkeys(caches, 0), {})
    client = _FakeClient(geometries)
    vllm_stream = object()
    worker = WorkerSide(
        layer_map,
        bound,
        lambda: client,  # type: ignore[arg-type,return-value]
        {"full": 4},
        page_size_tokens=16,
        retry_after_s=0.01,
        state_load_block=state_load_block,
        state_store_block=state_store_block,
        register=lambda c: None,
        stream=lambda: vllm_stream,
    )
    worker.store([StoreJob("a", tuple(range(32)), 0, ((1, 2, 0),), 32)])
    worker.before_forward()
    assert client.fences_recorded == [(vllm_stream, threading.get_ident())]
    assert client.store_fences == [("event 1", None)]  # that fence, sent by the store thread


def test_a_direct_store_leaves_the_step_and_the_next_forward_waits_for_its_reply() -> None:
    """wait_for_save returns with the store still in the sidecar's hands; before the next
    forward (which may overwrite a block the store reads) its reply is in."""
    worker, client = _worker(staging_pages=4, direct=True)
    client.store_gate = threading.Event()
    worker.store([StoreJob("a", tuple(range(32)), 0, ((1, 2, 0),), 32)])  # returns: not waited
    assert client.stores_finished == 0
    seen: list[int] = []

    def next_step() -> None:
        worker.before_forward()
        seen.append(client.stores_finished)  # what had finished when it let the forward go

    step = threading.Thread(target=next_step)
    step.start()
    client.store_entered.wait(timeout=60)
    client.store_gate.set()
    step.join(timeout=60)
    assert seen == [1]


def test_a_direct_store_with_no_reply_waits_until_its_session_ended() -> None:
    """No reply in time: the sidecar may still read vLLM's blocks. The next forward waits
    until a reconnect registered vLLM's memory again (refused while the old session lives)."""
    worker, client = _worker(staging_pages=4, direct=True)
    client.store_error = TimeoutError("timed out")
    client.stats_refusals = 2
    worker.store([StoreJob("a", tuple(range(32)), 0, ((1, 2, 0),), 32)])
    worker.before_forward()
    assert client.stats_calls == 3  # refused twice, then the memory was ours again
    assert worker.counters.store_failures == 1
    assert worker.counters.stores_unconfirmed == 0
    worker.before_forward()
    assert client.stats_calls == 3  # settled: nothing more to wait for


def test_a_store_that_timed_out_keeps_its_staging_pages_from_the_next_store() -> None:
    """No reply in time: the sidecar may still be backing the store up from its staging
    pages. Handed to the next step's store, they would be overwritten while it reads them,
    and another prompt's bytes filed under the first prompt's keys."""
    worker, client = _worker(staging_pages=6)
    client.store_error = TimeoutError("timed out")
    worker.store([StoreJob("a", tuple(range(32)), 0, ((1, 2, 3),), 32)])
    [first] = client.stores
    client.store_error = None
    worker.store([StoreJob("b", tuple(range(100, 132)), 0, ((4, 5, 6),), 32)])
    [_, second] = client.stores
    assert not set(first["full"]) & set(second["full"]), (first, second)
    assert worker.counters.staging_quarantined == 2
    assert worker.counters.store_failures == 1
    # a store the sidecar answered (even with an error) gives its pages back
    client.store_error = ClientError("busy", "every L2 page is pinned")
    worker.store([StoreJob("c", tuple(range(200, 264)), 0, ((1, 2, 3, 4, 5),), 64)])
    assert worker.staging.free() == {"full": 3}


def test_staging_pages_of_a_store_without_reply_come_back_once_its_session_is_over() -> None:
    """Quarantined under the store's epoch: out of use while the sidecar has not confirmed
    that session over, free again (and counted) once a later registration did."""
    worker, client = _worker(staging_pages=6)
    client.store_error = NoReplyError("store", Epoch(None, 1), 0.1)
    worker.store([StoreJob("a", tuple(range(32)), 0, ((1, 2, 3),), 32)])
    client.store_error = None
    assert worker.staging.free() == {"full": 3}
    assert worker.staging.quarantined() == 2
    worker.before_forward()  # no call reconnected yet: session 1 not confirmed over
    assert worker.staging.free() == {"full": 3}
    assert worker.counters.staging_reclaimed == 0
    client.stats()  # a call that reconnected and registered the pool again (session 2)
    worker.before_forward()
    assert worker.staging.free() == {"full": 5}
    assert worker.counters.staging_reclaimed == 2
    assert worker.staging.quarantined() == 0


def test_a_direct_load_whose_start_got_no_reply_holds_the_next_forward_until_settled() -> None:
    """The load may still be writing vLLM's blocks in the sidecar: before the next forward
    the worker waits until the sidecar confirmed the load's session over."""
    worker, client = _worker(staging_pages=4, direct=True)
    client.load_error = NoReplyError("load", Epoch(None, 1), 0.1)
    client.stats_refusals = 1  # the old session still runs: the first try is refused
    worker.start_loads([LoadJob("a", tuple(range(32)), 0, ((1, 2, 0),))])
    worker.wait_layer(max(worker.bindings))
    worker.finish_loads()
    assert worker.take_load_errors() == {1, 2}
    assert client.stats_calls == 0  # nothing waited for inside the step
    worker.before_forward()
    assert client.stats_calls == 2  # refused once, then registered again: confirmed
    assert worker.counters.stores_unconfirmed == 0


def test_a_starved_load_is_counted_and_says_what_was_free() -> None:
    worker, client = _worker(staging_pages=4)
    jobs = [
        LoadJob(name, tuple(range(32)), 0, ((1 + 2 * i, 2 + 2 * i, 0),))
        for i, name in enumerate(("a", "b"))
    ]
    worker.start_loads(jobs)
    assert len(client.loads) == 1  # the second found one free page of the three
    assert worker.counters.loads_starved == 1
    assert client.loads_starved == 1  # told to the sidecar with the next heartbeat
    assert worker.counters.errors[-1] == (
        "request b: its load needs {'full': 2} staging pages; free now: {'full': 1} of "
        "{'full': 4}; recomputed (raise staging_pages)"
    )
    worker.wait_layer(max(worker.bindings))
    assert worker.take_load_errors() == {3, 4}  # b's blocks: vLLM recomputes them
    assert worker.staging.free() == {"full": 3}


def test_starved_loads_reach_the_sidecars_stats_and_metrics(tmp_path: Path) -> None:
    """What engines report with their heartbeats: `/v1/stats` and Prometheus both count it."""
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        f"model:\n  config_path: {shared_model('llama-3.1-8b.json')}\n  page_size_tokens: 16\n"
        "host:\n  capacity_bytes: 16MiB\n"
        f"storage:\n  kind: file\n  path: {tmp_path / 'l3'}\n"
        f"service:\n  socket_path: {tmp_path / 'e.sock'}\n  http_port: 0\n"
    )
    with SidecarProcess(deploy) as sidecar:
        layer_map = LayerMap(load_layout(shared_model("llama-3.1-8b.json")))
        with connect(sidecar.socket, layer_map, heartbeat=False) as client:
            client.starved(2)
            client.call("heartbeat", client._heartbeat_args())
            client.call("heartbeat", client._heartbeat_args())  # nothing new: not sent again
        assert sidecar.get_json("/v1/stats")["engine_loads_starved"] == 2
        status, metrics = sidecar.get("/metrics")
    assert status == 200
    assert "hicache_engine_loads_starved_total 2.0" in metrics


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"config": "x", "colour": 1},
            r"kv_connector_extra_config: unknown keys \['colour'\]; allowed: config, address",
        ),
        (
            {},
            r"kv_connector_extra_config: give 'config' \(the sidecar's deploy.yaml\) or 'address'",
        ),
        (
            {"address": "s", "load_timeout_s": "soon"},
            r"kv_connector_extra_config.load_timeout_s: 'soon' is not a positive number",
        ),
        (
            {"address": "s", "staging_pages": 0},
            r"kv_connector_extra_config.staging_pages: 0 is not a positive number",
        ),
        (
            {"address": "s", "load_mode": "eager"},
            r"kv_connector_extra_config.load_mode: 'eager' is not one of auto, layerwise, async",
        ),
    ],
)
def test_extra_config_errors_name_the_key_and_what_is_allowed(
    extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        ConnectorSettings.parse(extra)


def test_settings_read_the_socket_and_token_from_the_deployment(tmp_path: Path) -> None:
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        f"model:\n  config_path: {shared_model('llama-3.1-8b.json')}\n"
        f"service:\n  socket_path: {tmp_path / 'e.sock'}\n  token: s3cret\n"
    )
    settings = ConnectorSettings.parse({"config": str(deploy)})
    assert (settings.address, settings.token, settings.load_mode) == (
        str(tmp_path / "e.sock"),
        "s3cret",
        "auto",
    )
