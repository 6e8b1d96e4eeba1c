"""The store's ordering contract (issue #15), end to end on the CPU with a recording backend:
`TieredCache.store` takes the caller's fence (or makes one on entry, on the caller's thread)
and hands exactly that to the backup walk; the scheduler drops it when the op ends; the
sidecar waits on the engine's IPC event only (never a fence of its own streams) and refuses
one for shared-memory pools; the wire field is exactly an IPC event handle; the clients send
a fence only for CUDA pools. The GPU side is in tests/transfer/test_cuda_backend.py and
tests/service/test_cuda_ipc.py."""

from __future__ import annotations

import asyncio
import gc
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
from hicache.client.base import ClientBase, store_args
from hicache.client.handle import ClientError
from hicache.memory import GroupGeometry
from hicache.model import LayerMap, load_layout
from hicache.service.ops_data import store_fence
from hicache.transfer import NO_FENCE, CpuCopyBackend, Direction, Fence
from hicache.transfer.backend import CancelToken, LayerListener, LayerPart, WalkDone, WalkSignals
from tests.conftest import shared_model
from tests.pages import split_store

PAGE = 4


class Marker(Fence):
    def __init__(self, thread: str):
        self.thread = thread


class Recording(CpuCopyBackend):
    """Records the fences it makes (and on which thread) and each backup walk's `after`."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[Marker] = []
        self.after: list[Fence | None] = []

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
        if direction is Direction.BACKUP:
            self.after.append(after)
        return super().submit_walk(direction, layers, done, after, cancel, on_layer)


def build(backend: Recording) -> TieredCache:
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


def test_the_sidecar_never_makes_a_fence_of_its_own() -> None:
    backend = CpuCopyBackend()
    try:
        assert store_fence(backend, None) is NO_FENCE
        with pytest.raises(p.RequestError, match=r"store\.fence: an IPC event handle orders CUDA"):
            store_fence(backend, b"\0" * 64)
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
    fence = store_fence(Cuda(), handle)  # type: ignore[arg-type]
    assert isinstance(fence, Marker)
    assert opened == [handle]


def test_the_wire_fence_is_exactly_an_ipc_event_handle() -> None:
    args = {"tokens": [1, 2], "device_pages": {"full": []}}
    assert p.StoreRequest.model_validate(args).fence is None
    assert p.StoreRequest.model_validate({**args, "fence": b"\1" * 64}).fence == b"\1" * 64
    for bad in (b"\1" * 63, b"\1" * 65, "x" * 64):
        with pytest.raises(ValidationError):
            p.StoreRequest.model_validate({**args, "fence": bad})


def test_clients_send_a_fence_only_for_cuda_pools() -> None:
    assert "fence" not in store_args([1], {"g": [0]}, None)
    assert store_args([1], {"g": [0]}, None, b"h" * 64)["fence"] == b"h" * 64
    layer_map = LayerMap(load_layout(shared_model("gpt_oss_20b.json")))
    client = ClientBase(layer_map, "float16", PAGE, 0, "", None, "")
    assert client._store_fence(None) == (None, None)  # shared-memory pools: written before
    with pytest.raises(ClientError, match="a stream orders CUDA work"):
        client._store_fence(object())


@pytest.mark.asyncio
async def test_every_stores_event_lives_until_its_request_is_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More stores in flight than the client keeps events for afterwards (asyncio.gather on
    one AsyncClient): each event must still be alive when its request goes out and until
    its reply (an imported event whose exporter destroyed it is undefined)."""
    import collections
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
    client._fences = collections.deque(maxlen=8)
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
    assert len(client._fences) == 8  # and the last few are kept past their replies


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


@pytest.mark.gpu
@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["taken_on_entry", "explicit_fence"])
async def test_an_embedded_store_waits_for_kernels_on_the_engines_stream(how: str) -> None:
    """The engine's kernels write the pages on a side stream behind a long kernel; the store
    is called at once. Its backup must see the final bytes (0x5A), not the zeros before."""
    from hicache.transfer.cuda_backend import CudaCopyBackend

    layer_map = LayerMap(load_layout(shared_model("gpt_oss_20b.json")))
    geoms = [GroupGeometry(g, torch.float16, PAGE) for g in layer_map.groups]
    backend = CudaCopyBackend(0, staging_bytes=16 * 2**20)
    embedded = by_key.embedded(
        layer_map,
        dtype=torch.float16,
        page_size_tokens=PAGE,
        host_capacity_bytes=32 * sum(g.page_bytes for g in geoms),
        device_pages=16,
        backend=backend,
    )
    cache = by_key.tiered(embedded)
    try:
        async with cache.running():
            torch.cuda.synchronize()
            tokens = list(range(16))
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            with torch.cuda.stream(side):
                gpu_sleep(0.5)
                for pool in embedded.device_pools.values():
                    for layer in pool.tensors:
                        for t in layer.values():
                            t.view(torch.uint8).fill_(0x5A)
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
