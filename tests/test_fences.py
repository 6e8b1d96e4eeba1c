"""The ordering contract of stores (issue #15) and loads (#25), end to end on the CPU with a
recording backend: `TieredCache.store` and `.load` take the caller's fence (or make one on
entry, on the caller's thread) and hand exactly that to their walk — a merged load walk
waits on every op's; the scheduler drops them when the op ends; the sidecar waits on the
engine's IPC event only (never a fence of its own streams) and refuses one for shared-memory
pools; the wire field is exactly an IPC event handle; the clients send a fence only for CUDA
pools. A load must be ordered after the engine's work that still uses or zeroes the pages it
fills (vLLM zeroes newly allocated blocks on its stream before the forward that loads into
them). The GPU side is in tests/transfer/test_cuda_backend.py and
tests/service/test_cuda_ipc.py."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import weakref
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from hicache.assembly import by_key
from hicache.cache import TieredCache
from hicache.channel import protocol as p
from hicache.client.base import ClientBase, load_args, store_args
from hicache.client.handle import ClientError
from hicache.memory import GroupGeometry
from hicache.model import LayerMap, load_layout
from hicache.scheduler import GroupPages
from hicache.service.ops_data import engine_fence
from hicache.transfer import NO_FENCE, CopyBackend, CpuCopyBackend, Direction, Fence
from hicache.transfer.backend import (
    CancelToken,
    JoinedFence,
    LayerListener,
    LayerPart,
    WalkDone,
    WalkSignals,
)
from tests.conftest import shared_model
from tests.pages import split_store

PAGE = 4


class Marker(Fence):
    def __init__(self, thread: str):
        self.thread = thread


class Recording(CpuCopyBackend):
    """Records the fences it makes (and on which thread) and each walk's `after`: backups'
    in `after`, loads' in `load_after`."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[Marker] = []
        self.after: list[Fence | None] = []
        self.load_after: list[Fence | None] = []

    def producer_fence(self, stream: object | None = None) -> Fence | None:
        marker = Marker(threading.current_thread().name)
        self.made.append(marker)
        return marker

    def submit_walk(
        self,
        direction: Direction,
        layers: Sequence[Sequence[LayerPart]],
        done: WalkDone,
        after: Fence | None = None,
        cancel: CancelToken | None = None,
        on_layer: LayerListener | None = None,
    ) -> WalkSignals:
        (self.after if direction is Direction.BACKUP else self.load_after).append(after)
        return super().submit_walk(direction, layers, done, after, cancel, on_layer)


def build(backend: CopyBackend) -> TieredCache:
    layer_map = LayerMap(load_layout(shared_model("gpt_oss_20b.json")))
    geoms = [GroupGeometry(g, torch.float16, PAGE) for g in layer_map.groups]
    embedded = by_key.embedded(
        layer_map,
        dtype=torch.float16,
        page_size_tokens=PAGE,
        host_capacity_bytes=32 * sum(g.page_bytes for g in geoms),
        device_pages=16,
        backend=backend,
    )
    return by_key.tiered(embedded)


def store_kwargs(cache: TieredCache, tokens: list[int]) -> dict[str, Any]:
    pages = {g: list(range(len(tokens) // PAGE)) for g in cache.index.rules}
    device, snapshots = split_store(
        {g: r.kind for g, r in cache.index.rules.items()}, tokens, pages, PAGE
    )
    return {"device_pages": device, "snapshots": snapshots}


@pytest.mark.asyncio
async def test_store_without_a_fence_takes_one_on_entry_and_waits_on_it() -> None:
    backend = Recording()
    cache = build(backend)
    try:
        async with cache.running():
            tokens = list(range(16))
            result = await cache.store(tokens, **store_kwargs(cache, tokens))
            assert result.pages_stored > 0
        assert len(backend.made) == 1  # once, on entry (not again at the scheduler)
        assert backend.made[0].thread == threading.current_thread().name
        assert backend.after == [backend.made[0]]
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("given", ["marker", "none"])
async def test_store_hands_the_callers_fence_to_the_backup_and_drops_it_after(
    given: str,
) -> None:
    backend = Recording()
    cache = build(backend)
    try:
        async with cache.running():
            fence: Fence = Marker("engine") if given == "marker" else NO_FENCE
            held = weakref.ref(fence)
            tokens = list(range(20))
            stored = await cache.store(tokens, **store_kwargs(cache, tokens), fence=fence)
            assert stored.pages_stored > 0
            assert backend.made == []  # the caller's fence, no other
            assert backend.after == [fence]
            if given == "marker":
                backend.after.clear()
                del fence
                gc.collect()
                assert held() is None  # nothing of the scheduler keeps it past the op
    finally:
        cache.embedded.close()


def load_pages(cache: TieredCache, tokens: list[int], first: int) -> dict[str, list[int]]:
    return {g: list(range(first, first + len(tokens) // PAGE)) for g in cache.index.rules}


@pytest.mark.asyncio
async def test_a_load_without_a_fence_takes_one_on_entry_and_its_walk_waits_on_it() -> None:
    backend = Recording()
    cache = build(backend)
    try:
        async with cache.running():
            tokens = list(range(16))
            fence = Marker("engine")
            await cache.store(tokens, **store_kwargs(cache, tokens), fence=fence)
            handle, hit = await cache.load([*tokens[:-1], 99], load_pages(cache, tokens, 8))
            assert handle is not None
            assert hit.tokens_total > 0
            await handle.done()
        assert len(backend.made) == 1  # the load's, once, on entry (the store brought its own)
        assert backend.made[0].thread == threading.current_thread().name
        assert backend.load_after == [backend.made[0]]
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
async def test_a_merged_load_walk_waits_on_its_steps_fence_and_drops_it_after() -> None:
    """One engine step's loads go as one merged walk (`load_step`): it waits on the step's
    fence, and nothing keeps the fence once the ops ended."""
    backend = Recording()
    cache = build(backend)
    try:
        async with cache.running():
            tokens = list(range(16))
            await cache.store(tokens, **store_kwargs(cache, tokens), fence=NO_FENCE)
            plan = cache.planner.plan_load(cache.index.keys(tokens), 0)
            scheduler = cache.embedded.scheduler
            fence = Marker("engine")
            held = weakref.ref(fence)

            def step(first: int) -> dict[str, GroupPages]:  # as TieredCache.load asks
                pages = {}
                for group, rows in plan.hit.needed.items():
                    token = cache.index.rules[group].kind.is_token_cache
                    pages[group] = GroupPages(
                        tuple(range(first, first + len(rows))) if token else (first,),
                        tuple(r.l2_page for _, r in rows if r.l2_page is not None),
                        num_tokens=plan.hit.pages_l2 * PAGE if token else None,
                        first_page=rows[0][0] if token else 0,
                    )
                return pages

            steps = [step(4), step(10)]
            handles = await scheduler.load_step(steps, fence=fence)
            for handle in handles:
                await handle.done()
            cache.planner.release_load(plan)
            assert scheduler.stats().merged_walks == 1
            assert backend.made == []
            assert backend.load_after == [fence]
            backend.load_after.clear()
            del fence, handles
            gc.collect()
            assert held() is None  # nothing of the scheduler keeps it past the ops
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("op", ["store", "load"])
async def test_a_default_fence_is_taken_on_the_callers_thread_not_the_loops(op: str) -> None:
    """Issue #36, finding 10: an engine thread hands `cache.store(...)` / `cache.load(...)`
    to the cache's event loop (`run_coroutine_threadsafe`); the fence must mark the engine
    thread's stream, so it is taken when the call is made, there — on 7767ef8 it was taken
    when the coroutine first ran, on the loop's thread (the loop's own current stream)."""
    backend = Recording()
    cache = build(backend)
    try:
        async with cache.running():
            tokens = list(range(16))
            await cache.store(tokens, **store_kwargs(cache, tokens), fence=NO_FENCE)
            loop = asyncio.get_running_loop()

            def engine() -> Any:
                if op == "store":
                    longer = [*tokens, *range(100, 104)]
                    call = cache.store(longer, **store_kwargs(cache, longer))
                else:
                    call = cache.load(tokens, load_pages(cache, tokens, 8))
                return asyncio.run_coroutine_threadsafe(call, loop)  # type: ignore[arg-type]

            engine_thread = "engine-thread"
            done: list[Any] = []
            worker = threading.Thread(target=lambda: done.append(engine()), name=engine_thread)
            worker.start()
            await asyncio.to_thread(worker.join)
            result = await asyncio.wrap_future(done[0])
            if op == "load":
                handle, _ = result
                assert handle is not None
                await handle.done()
        assert [m.thread for m in backend.made] == [engine_thread]
        walked = backend.after if op == "store" else backend.load_after
        assert walked[-1] is backend.made[0]
    finally:
        cache.embedded.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("op", ["backup", "load", "load_step"])
async def test_the_schedulers_default_fence_is_taken_on_the_callers_thread(op: str) -> None:
    """Finding 10's rule at the scheduler's own entry points: `Scheduler.backup`, `.load`
    and `.load_step` called on an engine thread and handed to the loop
    (`run_coroutine_threadsafe`) fence that thread's stream — taken when called, not when
    the coroutine first runs on the loop's thread."""
    backend = Recording()
    cache = build(backend)
    try:
        async with cache.running():
            tokens = list(range(16))
            await cache.store(tokens, **store_kwargs(cache, tokens), fence=NO_FENCE)
            plan = cache.planner.plan_load(cache.index.keys(tokens), 0)
            scheduler = cache.embedded.scheduler
            pages = {}
            for group, rows in plan.hit.needed.items():
                token = cache.index.rules[group].kind.is_token_cache
                pages[group] = GroupPages(
                    tuple(range(4, 4 + len(rows))) if token else (4,),
                    ()
                    if op == "backup"
                    else tuple(r.l2_page for _, r in rows if r.l2_page is not None),
                    num_tokens=plan.hit.pages_l2 * PAGE if token else None,
                    first_page=rows[0][0] if token else 0,
                )
            loop = asyncio.get_running_loop()
            backend.made.clear()

            def engine() -> Any:
                call: Any = (
                    scheduler.backup(pages)
                    if op == "backup"
                    else scheduler.load(pages)
                    if op == "load"
                    else scheduler.load_step([pages])
                )
                return asyncio.run_coroutine_threadsafe(call, loop)

            done: list[Any] = []
            worker = threading.Thread(target=lambda: done.append(engine()), name="engine-thread")
            worker.start()
            await asyncio.to_thread(worker.join)
            result = await asyncio.wrap_future(done[0])
            for handle in result if op == "load_step" else [result]:
                assert (await handle.done()).ok
            cache.planner.release_load(plan)
        assert [m.thread for m in backend.made] == ["engine-thread"]
        walked = backend.after if op == "backup" else backend.load_after
        assert walked[-1] is backend.made[0]
    finally:
        cache.embedded.close()


def test_a_merged_walk_joins_distinct_fences_once_each() -> None:
    backend = CpuCopyBackend()
    try:
        first, second = Marker("a"), Marker("b")
        assert backend.join_fences([None, None]) is None
        assert backend.join_fences([first, None, first]) is first
        joined = backend.join_fences([first, second, first])
        assert isinstance(joined, JoinedFence)
        assert joined.fences == (first, second)
    finally:
        backend.close()


def test_the_sidecar_never_makes_a_fence_of_its_own() -> None:
    backend = CpuCopyBackend()
    try:
        for op in ("store", "load"):
            assert engine_fence(backend, None, op) is NO_FENCE
            with pytest.raises(p.RequestError, match=rf"^{op}\.fence: an IPC event handle orders"):
                engine_fence(backend, b"\0" * 64, op)
    finally:
        backend.close()


def test_a_cuda_sidecar_opens_the_engines_handle() -> None:
    opened: list[bytes] = []

    class Cuda(SimpleNamespace):
        pins_host_memory = True

        def import_fence(self, handle: bytes) -> Fence:
            opened.append(handle)
            return Marker("sidecar")

    handle = bytes(range(64))
    fence = engine_fence(Cuda(), handle, "store")  # type: ignore[arg-type]
    assert isinstance(fence, Marker)
    assert opened == [handle]


@pytest.mark.parametrize("request_model", [p.StoreRequest, p.LoadRequest])
def test_the_wire_fence_is_exactly_an_ipc_event_handle(request_model: type[p.Msg]) -> None:
    args = {"tokens": [1, 2], "device_pages": {"full": []}}
    assert request_model.model_validate(args).fence is None  # type: ignore[attr-defined]
    fenced = request_model.model_validate({**args, "fence": b"\1" * 64})
    assert fenced.fence == b"\1" * 64  # type: ignore[attr-defined]
    for bad in (b"\1" * 63, b"\1" * 65, "x" * 64):
        with pytest.raises(ValidationError):
            request_model.model_validate({**args, "fence": bad})


def test_clients_send_a_fence_only_for_cuda_pools() -> None:
    assert "fence" not in store_args([1], {"g": [0]}, None)
    assert store_args([1], {"g": [0]}, None, b"h" * 64)["fence"] == b"h" * 64
    assert "fence" not in load_args([1], {"g": [0]}, 0)
    assert load_args([1], {"g": [0]}, 0, b"h" * 64)["fence"] == b"h" * 64
    layer_map = LayerMap(load_layout(shared_model("gpt_oss_20b.json")))
    client = ClientBase(layer_map, "float16", PAGE, 0, "", None, "")
    assert client._engine_fence(None, "store") == (
        None,
        None,
    )  # shared-memory pools: written before
    for op in ("store", "load"):
        with pytest.raises(ClientError, match=rf"^bad_request: {op}: a stream orders CUDA work"):
            client._engine_fence(object(), op)


@pytest.mark.asyncio
async def test_every_stores_event_lives_until_its_request_is_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More stores in flight than the client keeps events for afterwards (asyncio.gather on
    one AsyncClient): each event must still be alive when its request goes out and until
    its reply (an imported event whose exporter destroyed it is undefined)."""
    import weakref

    import hicache.client.aio as aio
    import hicache.transfer.cuda_ipc as cuda_ipc

    class Event:
        pass

    refs: dict[bytes, weakref.ref[Event]] = {}

    def export_fence(device: object, stream: object = None) -> tuple[Event, bytes]:
        event = Event()
        handle = len(refs).to_bytes(2, "little") * 32
        refs[handle] = weakref.ref(event)
        return event, handle

    monkeypatch.setattr(cuda_ipc, "export_fence", export_fence)
    monkeypatch.setattr(aio, "store_args", lambda t, d, s, fence: {"fence": fence})
    client = aio.AsyncClient.__new__(aio.AsyncClient)
    client.cuda_device = "cuda:0"  # type: ignore[assignment]
    client._unanswered_fences = []
    client._fences_lock = threading.Lock()
    client.epoch = None
    lock = asyncio.Lock()
    alive: list[bool] = []

    async def call(op: str, args: dict[str, bytes]) -> dict[str, int]:
        async with lock:  # the real call() sends one request at a time
            for _ in range(3):
                await asyncio.sleep(0)
                gc.collect()
                alive.append(refs[args["fence"]]() is not None)
            return {}

    client.call = call  # type: ignore[method-assign]
    await asyncio.gather(*(client.store([1], {"g": [0]}) for _ in range(20)))
    assert len(alive) == 60
    assert all(alive)
    gc.collect()  # answered: the sidecar holds nothing of them, so nothing keeps them here
    assert [handle for handle, ref in refs.items() if ref() is not None] == []
    assert client._unanswered_fences == []


def test_a_fence_event_lives_while_the_sidecar_may_still_wait_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's event of a store with no reply lives until its session is confirmed
    over, and a load's until the load ended, however many fenced requests go meanwhile
    (the client kept a ring of its last 8: a ninth fenced request destroyed the event the
    sidecar could still wait on, undefined in CUDA); an answered store's or an error
    reply's event goes at once."""
    import hicache.client.engine as engine
    import hicache.transfer.cuda_ipc as cuda_ipc
    from hicache.channel.counters import CounterFile, LoadState
    from hicache.client.base import _process_start
    from hicache.client.handle import Epoch, NoReplyError

    class Event:
        pass

    refs: list[weakref.ref[Event]] = []

    def export_fence(device: object, stream: object = None) -> tuple[Event, bytes]:
        event = Event()
        refs.append(weakref.ref(event))
        return event, len(refs).to_bytes(2, "little") * 32

    monkeypatch.setattr(cuda_ipc, "export_fence", export_fence)
    client = engine.Client.__new__(engine.Client)
    client.cuda_device = "cuda:0"
    client._unanswered_fences = []
    client._fences_lock = threading.Lock()
    client.sidecar_process = (os.getpid(), _process_start(os.getpid()))  # alive throughout
    client.session = {"session": 1}
    client.epoch = Epoch(client.sidecar_process, 1)
    client.layer_map = LayerMap(load_layout(shared_model("gpt_oss_20b.json")))
    client.counters = CounterFile.create(2)
    client.generation, client.stalls = 1, []
    replies: list[Any] = []

    def call(op: str, args: dict[str, Any]) -> dict[str, Any]:
        reply = replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    client.call = call  # type: ignore[method-assign]

    def alive() -> list[bool]:
        gc.collect()
        return [ref() is not None for ref in refs]

    replies.append(NoReplyError("store", client.now(), 1.0))
    with pytest.raises(NoReplyError):
        client.store([1], {"g": [0]})  # may still run in session 1
    replies.append(ClientError("busy", "store: refused"))
    with pytest.raises(ClientError):
        client.store([1], {"g": [0]})  # answered: nothing of it runs
    load = {"load_id": 7, "slot": 0, "tokens": 4, "failed": {}, "session": 1}
    replies.append(load)
    handle = client.load([1, 2, 3, 4], {"g": [0]})
    assert handle is not None
    replies.extend({} for _ in range(20))
    for _ in range(20):  # more fenced requests than the old ring held, each answered
        client.store([1], {"g": [0]})
    assert alive() == [True, False, True] + [False] * 20
    client.counters.start(0, 7, 1)
    client.counters.end(0, LoadState.DONE, "")
    released: list[int] = []
    handle._release = released.append
    assert handle.done() == "done"
    assert released == [7]
    assert alive()[:3] == [True, False, False]  # the load ended: its event may go
    client.epoch = Epoch(client.sidecar_process, 2)  # registered again: session 1 ended
    replies.append({})
    client.store([1], {"g": [0]})
    assert alive() == [False] * 24
    assert client._unanswered_fences == []
    client.counters.close()


def test_the_cpu_backends_host_memory_is_unpinned_and_exact() -> None:
    backend = CpuCopyBackend()
    try:
        buffer = backend.alloc_host(3 * 2**20 + 17)
        assert buffer.numel() == 3 * 2**20 + 17
        assert not backend.pins_host_memory
        assert backend.producer_fence() is None
    finally:
        backend.close()


# ---- on a device -----------------------------------------------------------------------------


def gpu_sleep(seconds: float) -> None:
    """Keep the current stream busy for about `seconds` (clock_rate is in kHz)."""
    rate = getattr(torch.cuda.get_device_properties(0), "clock_rate", 2_000_000)
    torch.cuda._sleep(int(seconds * rate * 1e3))  # type: ignore[no-untyped-call]


def fill_pools(cache: TieredCache, byte: int) -> None:
    """Every byte of the engine's device pools set to `byte`, on the current stream."""
    for pool in cache.embedded.device_pools.values():
        for layer in pool.tensors:
            for t in layer.values():
                t.view(torch.uint8).fill_(byte)


@pytest.mark.gpu
@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["taken_on_entry", "explicit_fence"])
async def test_an_embedded_store_waits_for_kernels_on_the_engines_stream(how: str) -> None:
    """The engine's kernels write the pages on a side stream behind a long kernel; the store
    is called at once. Its backup must see the final bytes (0x5A), not the zeros before."""
    from hicache.transfer.cuda_backend import CudaCopyBackend

    backend = CudaCopyBackend(0, staging_bytes=16 * 2**20)
    cache = build(backend)
    embedded = cache.embedded
    try:
        async with cache.running():
            torch.cuda.synchronize()
            tokens = list(range(16))
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            with torch.cuda.stream(side):
                gpu_sleep(0.5)
                fill_pools(cache, 0x5A)
                if how == "taken_on_entry":  # on this thread, whose current stream is `side`
                    result = await cache.store(tokens, **store_kwargs(cache, tokens))
            if how == "explicit_fence":
                fence = backend.producer_fence(side)
                result = await cache.store(tokens, **store_kwargs(cache, tokens), fence=fence)
            assert result.pages_stored > 0
            torch.cuda.synchronize()
            landed = 0
            for name, pool in embedded.host_tier.pools.items():
                ones = int((pool.buffer == 0x5A).sum())
                assert ones % pool.geometry.page_bytes == 0, name
                landed += ones // pool.geometry.page_bytes
            assert landed == result.pages_stored, "the backup read pages before they were written"
    finally:
        embedded.close()


@pytest.mark.gpu
@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["taken_on_entry", "explicit_fence"])
async def test_an_embedded_load_lands_after_the_engine_zeroed_its_pages(how: str) -> None:
    """vLLM's order on CUDA: newly allocated blocks are zeroed on the engine's stream, then
    the forward's load fills them. Here the zeroing runs behind a long kernel on a side stream
    and the load is called at once: the loaded bytes (0x5A) must survive, not the zeros."""
    from hicache.transfer.cuda_backend import CudaCopyBackend

    backend = CudaCopyBackend(0, staging_bytes=16 * 2**20)
    cache = build(backend)
    embedded = cache.embedded
    try:
        async with cache.running():
            fill_pools(cache, 0x5A)
            tokens = list(range(16))
            result = await cache.store(tokens, **store_kwargs(cache, tokens))
            assert result.pages_stored > 0
            torch.cuda.synchronize()
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            with torch.cuda.stream(side):
                gpu_sleep(0.5)
                fill_pools(cache, 0)  # the engine zeroes the pages before the load fills them
                if how == "taken_on_entry":  # on this thread, whose current stream is `side`
                    handle, hit = await cache.load(tokens, load_pages(cache, tokens, 0))
            if how == "explicit_fence":
                fence = backend.producer_fence(side)
                handle, hit = await cache.load(tokens, load_pages(cache, tokens, 0), fence=fence)
            assert handle is not None
            await handle.done()
            torch.cuda.synchronize()
            for name, pool in embedded.device_pools.items():  # gpt-oss: token groups only
                rows = [position for position, _ in hit.needed[name]]  # = its device page
                assert rows, name
                for layer in pool.tensors:
                    for t in layer.values():
                        loaded = t.view(torch.uint8).view(pool.num_pages, -1)
                        assert all(bool(loaded[i].eq(0x5A).all()) for i in rows), (
                            f"group {name!r}: the load landed before the engine's zeroing"
                        )
    finally:
        embedded.close()
