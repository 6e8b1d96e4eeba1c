"""The CUDA backend (issue #15): its pure parts on the CPU — chunking a layer through the
staging buffer, exact-size host mappings and chunked registration, the device-index upload
cache, device binding — and, marked `gpu`, the same on a device: a backup ordered after a
slow producer on a side stream, page_first copies that never block the submitting thread,
layers larger than staging, host buffers pinned at exactly their size, per-device backends."""

from __future__ import annotations

import gc
import mmap
import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from hicache.assembly import by_key
from hicache.errors import ConfigError, TransferError
from hicache.memory import DevicePool, GroupGeometry, HostPool
from hicache.memory.host_pool import HostLayout
from hicache.model import (
    CacheGroup,
    CacheKind,
    CacheSpec,
    KvFormat,
    LayerMap,
    LayerSpec,
    ModelLayout,
)
from hicache.transfer import (
    NO_FENCE,
    CpuCopyBackend,
    Direction,
    GroupMove,
    RowCopy,
    Rows,
    copy_layers_blocking,
)
from hicache.transfer.backend import Fence, LayerPart
from hicache.transfer.cuda_backend import CudaCopyBackend
from hicache.transfer.cuda_host import (
    UploadCache,
    chunk_runs,
    map_host_buffer,
    register_chunks,
)

# ---- chunking (pure) ----------------------------------------------------------------------


def expand(chunks: list[tuple[int, int, list[tuple[int, int, int]]]]) -> list[tuple[int, int]]:
    """(position, row) pairs a chunking covers, positions made absolute again."""
    out = []
    for a, b, runs in chunks:
        covered = 0
        for pos, first, length in runs:
            assert pos >= 0
            assert pos + length <= b - a
            out += [(a + pos + k, first + k) for k in range(length)]
            covered += length
        assert covered == b - a  # every position of the chunk, once
    return out


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 7, 100])
def test_chunks_cover_every_row_once_in_order_and_never_exceed_the_limit(limit: int) -> None:
    rng = random.Random(limit)
    for _ in range(50):
        ids = rng.sample(range(200), rng.randint(1, 40))
        runs = Rows.of(ids).runs()
        chunks = chunk_runs(runs, len(ids), limit)
        assert all(b - a <= limit for a, b, _ in chunks)
        assert [a for a, _, _ in chunks] == list(range(0, len(ids), limit))
        assert expand(chunks) == list(enumerate(ids))


def test_a_run_crossing_a_chunk_boundary_is_split_there() -> None:
    chunks = chunk_runs([(0, 10, 5), (5, 40, 2)], 7, 3)
    assert chunks == [
        (0, 3, [(0, 10, 3)]),
        (3, 6, [(0, 13, 2), (2, 40, 1)]),
        (6, 7, [(0, 41, 1)]),
    ]


def test_a_chunk_holds_at_least_one_row() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        chunk_runs([(0, 0, 4)], 4, 0)


# ---- exact host buffers and registration (pure) ----------------------------------------------


def mapping_size(ptr: int) -> int:
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            span = line.split()[0]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= ptr < high:
                return high - low
    raise AssertionError(f"{ptr:#x} is not mapped")


def test_a_host_buffer_is_exactly_the_size_asked_page_aligned_and_zero() -> None:
    nbytes = 5 * 2**20 + 3 * mmap.PAGESIZE + 123  # far from a power of two
    buffer, _ = map_host_buffer(nbytes)
    assert buffer.numel() == nbytes
    assert buffer.dtype == torch.uint8
    assert buffer.data_ptr() % mmap.PAGESIZE == 0
    # the kernel may merge neighbouring anonymous mappings: at most page-rounded plus them,
    # never a power of two's worth on its own
    assert mapping_size(buffer.data_ptr()) >= -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    assert int(buffer[:4096].max()) == 0
    assert int(buffer[-4096:].max()) == 0
    buffer[-1] = 7
    assert int(buffer[-1]) == 7


def test_the_tensor_keeps_its_mapping_alive() -> None:
    buffer, mapping = map_host_buffer(3 * mmap.PAGESIZE)
    del mapping
    gc.collect()
    view = buffer[100:200]
    del buffer
    gc.collect()
    view.fill_(9)
    assert int(view.sum()) == 900


def test_registration_goes_in_chunks_and_records_what_succeeded() -> None:
    calls: list[tuple[int, int]] = []

    def register(ptr: int, size: int) -> int:
        calls.append((ptr, size))
        return 0 if len(calls) < 3 else 2  # the third chunk fails (memlock)

    registered: list[tuple[int, int]] = []
    register_chunks(1000, 250, 100, lambda p, s: 0, registered)
    assert registered == [(1000, 100), (1100, 100), (1200, 50)]
    registered = []
    with pytest.raises(TransferError, match=r"100 bytes at offset 200 .* status 2; .*ulimit -l"):
        register_chunks(0, 350, 100, register, registered)
    assert registered == [(0, 100), (100, 100)]  # unregistered at close, not leaked


# ---- the upload cache (pure) -----------------------------------------------------------------


def test_an_index_is_uploaded_once_per_stream_and_forgotten_when_freed() -> None:
    cache = UploadCache(lambda t: t.clone())
    index = torch.tensor([3, 1, 2])
    first = cache.get("load", index)
    assert cache.get("load", index) is first
    assert cache.get("backup", index) is not first  # another stream gets its own upload
    assert cache.uploads == 2
    del index
    gc.collect()
    assert len(cache) == 0  # freed with its host tensor, not kept for 256 more


def test_a_new_index_that_reuses_a_freed_ones_id_gets_its_own_upload() -> None:
    # uploads stand-ins that are not tensors, so the freed tensor's memory goes to the next
    # tensor made (as on a device, where the upload lives in device memory)
    cache = UploadCache(lambda t: t.tolist())
    # CPython usually hands a freed object's address to the next one of its size, but not
    # always (it depends on what else was freed), so reuse is not asserted here; the test
    # below forges the collision deterministically
    for attempt in range(200):
        old = torch.tensor([attempt, attempt + 1])
        cache.get("load", old)
        del old
        new = torch.tensor([-1, -2])
        assert cache.get("load", new) == [-1, -2]  # never the old index's upload
        del new


def test_a_hit_needs_the_same_tensor_not_an_equal_id() -> None:
    """Even with an entry whose key collides (a stale id), the weak reference decides."""
    cache = UploadCache(lambda t: t.clone())
    a = torch.tensor([1, 2, 3])
    cache.get("load", a)
    b = torch.tensor([7, 8, 9])
    key = ("load", id(b))
    cache._entries[key] = cache._entries.pop(("load", id(a)))  # forge a's entry under b's id
    assert torch.equal(cache.get("load", b), b)


def test_the_cache_is_bounded() -> None:
    cache = UploadCache(lambda t: t.clone(), capacity=3)
    keep = [torch.tensor([i]) for i in range(5)]
    for t in keep:
        cache.get("load", t)
    assert len(cache) == 3


# ---- device binding (CPU) ----------------------------------------------------------------


def tiny_layout() -> tuple[LayerMap, GroupGeometry]:
    spec = CacheSpec(CacheKind.FULL, KvFormat.MHA, num_kv_heads=1, head_dim=8, v_head_dim=8)
    layout = ModelLayout.build("tiny", [LayerSpec(0, (spec,)), LayerSpec(1, (spec,))])
    return LayerMap(layout), GroupGeometry(layout.groups[0], torch.float16, 4)


def meta_pool(num_pages: int = 4) -> DevicePool:
    _, geometry = tiny_layout()
    layers = [
        {
            name: torch.empty((num_pages * 4, *shape), dtype=torch.float16, device="meta")
            for name, shape in geometry.tensors
        }
        for _ in range(2)
    ]
    return DevicePool(geometry, layers)


def test_a_backend_serves_its_own_device_only() -> None:
    backend = CpuCopyBackend()
    try:
        assert backend.for_device(torch.device("cpu")) is backend
        with pytest.raises(TransferError, match=r"pools on cuda:1, but this copy backend copies"):
            backend.for_device(torch.device("cuda", 1))
        with pytest.raises(TransferError, match="needs the CUDA copy backend"):
            backend.import_fence(b"\0" * 64)
        assert backend.producer_fence() is None
    finally:
        backend.close()


def test_embedded_refuses_pools_on_another_device_than_its_backend() -> None:

    pool = meta_pool()
    layer_map, geometry = tiny_layout()
    with pytest.raises(ConfigError, match=r"device pools on meta, but the copy backend copies"):
        by_key.embedded(
            layer_map,
            dtype=torch.float16,
            page_size_tokens=4,
            host_capacity_bytes=2**20,
            device_pools={geometry.name: pool},
        )


def test_pools_on_two_devices_are_refused() -> None:
    from hicache.embedded import pools_device

    _, geometry = tiny_layout()
    cpu = DevicePool.allocate(geometry, 2)
    with pytest.raises(ConfigError, match=r"device pools on 2 devices \(a on cpu, b on meta\)"):
        pools_device({"a": cpu, "b": meta_pool()})


def test_no_fence_orders_nothing() -> None:
    from hicache.transfer.cuda_events import CudaFence

    assert not isinstance(NO_FENCE, CudaFence)


# ---- on a device ---------------------------------------------------------------------------

gpu = pytest.mark.gpu


def gpu_sleep(seconds: float) -> None:
    """Keep the current stream busy for about `seconds` (`torch.cuda._sleep` spins clock
    cycles; the SM clock rate is in kHz; the boost clock makes it shorter, never longer)."""
    rate = getattr(torch.cuda.get_device_properties(0), "clock_rate", 2_000_000)
    torch.cuda._sleep(int(seconds * rate * 1e3))  # type: ignore[no-untyped-call]


@pytest.fixture
def cuda() -> Iterator[CudaCopyBackend]:
    made = CudaCopyBackend(0, staging_bytes=4 * 2**20)
    try:
        yield made
    finally:
        made.close()


def wait_walk(
    backend: CudaCopyBackend,
    direction: Direction,
    layers: list[list[LayerPart]],
    after: Fence | None = None,
) -> dict[int, BaseException]:
    finished = threading.Event()
    errors: dict[int, BaseException] = {}

    def done(e: dict[int, BaseException]) -> None:
        errors.update(e)
        finished.set()

    backend.submit_walk(direction, layers, done, after)
    assert finished.wait(60)
    return errors


@gpu
@pytest.mark.parametrize("pages", ["run", "index"])
def test_a_backup_waits_for_a_slow_producer_on_a_side_stream(
    cuda: CudaCopyBackend, pages: str
) -> None:
    backend = cuda
    device_rows = torch.zeros(64, 4096, dtype=torch.uint8, device="cuda")
    host = backend.alloc_host(64 * 4096).view(64, 4096)
    torch.cuda.synchronize()
    ids = list(range(8, 40)) if pages == "run" else random.Random(1).sample(range(64), 32)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        gpu_sleep(0.3)  # the producer is slow...
        device_rows.fill_(0xAB)  # ...and writes the pages last
        fence = backend.producer_fence()  # on the side stream
    copy = RowCopy(device_rows, Rows.of(ids), host, Rows.of(list(range(32))))
    assert not wait_walk(backend, Direction.BACKUP, [[(copy, 0)]], fence)
    assert int(host[:32].min()) == 0xAB, "the backup read the pages before the producer wrote"


@gpu
def test_an_explicit_stream_fence_is_recorded_on_that_stream(cuda: CudaCopyBackend) -> None:
    backend = cuda
    side = torch.cuda.Stream()
    device_rows = torch.zeros(16, 4096, dtype=torch.uint8, device="cuda")
    host = backend.alloc_host(16 * 4096).view(16, 4096)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        gpu_sleep(0.3)
        device_rows.fill_(5)
    fence = backend.producer_fence(side)  # from the default stream
    copy = RowCopy(device_rows, Rows.of(range(16)), host, Rows.of(range(16)))
    assert not wait_walk(backend, Direction.BACKUP, [[(copy, 0)]], fence)
    assert int(host.min()) == 5


def page_first_move(backend: CudaCopyBackend, pages: int = 48) -> tuple[DevicePool, HostPool]:
    spec = CacheSpec(CacheKind.FULL, KvFormat.MHA, num_kv_heads=4, head_dim=64, v_head_dim=64)
    geometry = GroupGeometry(CacheGroup("g", spec, (0, 1, 2)), torch.bfloat16, 16)
    device = DevicePool.allocate(geometry, pages, "cuda")
    for layer in device.tensors:
        for t in layer.values():
            t.view(torch.uint8).copy_(torch.randint_like(t.view(torch.uint8), 0, 256))
    host = HostPool(
        geometry,
        pages,
        "page_first",
        backend.alloc_host(pages * geometry.page_bytes),
    )
    host.buffer.copy_(torch.randint_like(host.buffer, 0, 256))
    torch.cuda.synchronize()
    return device, host


@gpu
@pytest.mark.parametrize("direction", [Direction.LOAD, Direction.BACKUP])
@pytest.mark.parametrize("pages", ["runs", "index"])
def test_page_first_copies_never_block_the_submitting_thread(
    cuda: CudaCopyBackend, direction: Direction, pages: str
) -> None:
    """The copy stream is kept busy first; a submit that staged through pageable memory (or
    synchronised at all) would return only after the busy work: it must return at once."""
    backend = cuda
    device, host = page_first_move(backend)
    rng = random.Random(2)
    dev_ids = list(range(4, 36)) if pages == "runs" else rng.sample(range(48), 32)
    host_ids = list(range(10, 42)) if pages == "runs" else rng.sample(range(48), 32)
    move = GroupMove.build(backend, device, host, dev_ids, host_ids)
    want_dev = [[r.clone() for r in device.layer_rows(i)] for i in range(3)]
    want_host = [[r.clone() for r in host.layer_rows(i)] for i in range(3)]
    stream = backend.load_stream if direction is Direction.LOAD else backend.backup_stream
    with torch.cuda.stream(stream):
        gpu_sleep(1.0)
    finished = threading.Event()
    started = time.perf_counter()
    signals = backend.submit_walk(
        direction, [[(move, i)] for i in range(3)], lambda e: finished.set()
    )
    took = time.perf_counter() - started
    assert not signals.is_done(0)  # the busy work still runs: nothing waited for it
    assert took < 0.25, f"submit_walk blocked for {took:.3f}s"
    assert finished.wait(60)
    for i in range(3):
        for t, (dev, hst) in enumerate(zip(device.layer_rows(i), host.layer_rows(i), strict=True)):
            for d, h in zip(dev_ids, host_ids, strict=True):
                if direction is Direction.LOAD:
                    assert torch.equal(dev[d].cpu(), want_host[i][t][h]), (i, t, d, h)
                else:
                    assert torch.equal(hst[h], want_dev[i][t][d].cpu()), (i, t, d, h)


@gpu
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("direction", [Direction.LOAD, Direction.BACKUP])
@pytest.mark.parametrize("pages", ["host_run", "host_runs", "both_runs"])
def test_a_layer_larger_than_staging_goes_through_in_chunks(
    layout: HostLayout, direction: Direction, pages: str
) -> None:
    spec = CacheSpec(CacheKind.FULL, KvFormat.MHA, num_kv_heads=2, head_dim=64, v_head_dim=64)
    geometry = GroupGeometry(CacheGroup("g", spec, (0, 1)), torch.float16, 16)  # 4 KiB rows
    backend = CudaCopyBackend(0, staging_bytes=3 * 4096 + 100)  # 3 rows per chunk
    try:
        device = DevicePool.allocate(geometry, 40, "cuda")
        for layer in device.tensors:
            for tensor in layer.values():
                raw = tensor.view(torch.uint8)
                raw.copy_(torch.randint_like(raw, 0, 256))
        host = HostPool(geometry, 40, layout, backend.alloc_host(40 * geometry.page_bytes))
        host.buffer.copy_(torch.randint_like(host.buffer, 0, 256))
        rng = random.Random(3)
        # 20 pages of 4 KiB per tensor and layer: 7 chunks; runs cross chunk boundaries
        dev_ids = list(range(11, 31)) if pages == "both_runs" else rng.sample(range(40), 20)
        host_ids = [*range(2, 9), *range(20, 33)] if pages == "host_runs" else list(range(5, 25))
        before_dev = [[r.clone() for r in device.layer_rows(i)] for i in range(2)]
        before_host = [[r.clone() for r in host.layer_rows(i)] for i in range(2)]
        move = GroupMove.build(backend, device, host, dev_ids, host_ids)
        copy_layers_blocking(backend, direction, [(move, [0, 1])])
        torch.cuda.synchronize()
        pairs = sorted(zip(host_ids, dev_ids, strict=True))
        for i in range(2):
            for k in range(len(geometry.tensors)):
                dev, hst = device.layer_rows(i)[k], host.layer_rows(i)[k]
                for h, d in pairs:
                    if direction is Direction.LOAD:
                        assert torch.equal(dev[d], before_host[i][k][h].cuda()), (i, k, d, h)
                    else:
                        assert torch.equal(hst[h], before_dev[i][k][d].cpu()), (i, k, d, h)
    finally:
        backend.close()


@gpu
def test_a_row_larger_than_staging_fails_its_layer_by_name() -> None:
    backend = CudaCopyBackend(0, staging_bytes=1024)
    try:
        src = torch.zeros(4, 4096, dtype=torch.uint8, device="cuda")
        dst = backend.alloc_host(4 * 4096).view(4, 4096)
        copy = RowCopy(src, Rows.of([3, 0]), dst, Rows.of([0, 1]))
        with pytest.raises(TransferError, match="one row of 4096 bytes exceeds the staging"):
            copy_layers_blocking(backend, Direction.BACKUP, [(copy, [0])])
    finally:
        backend.close()


@gpu
def test_host_buffers_are_pinned_at_exactly_their_size_and_unpinned_at_close() -> None:
    nbytes = 36 * 2**20 + 12345  # torch's pinned allocator would pin 64 MiB for this
    backend = CudaCopyBackend(0, staging_bytes=2**20, pin_chunk_bytes=16 * 2**20)
    buffer = backend.alloc_host(nbytes)
    assert buffer.numel() == nbytes
    assert backend.registered_bytes == nbytes  # in three chunks, exactly
    assert buffer.is_pinned()
    assert buffer[-1:].is_pinned()
    assert mapping_size(buffer.data_ptr()) < nbytes + 2 * 2**20
    # pinned means async: a D2H copy into it does not wait for the busy stream
    src = torch.full((nbytes,), 3, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        gpu_sleep(0.5)
        started = time.perf_counter()
        buffer.copy_(src, non_blocking=True)
        assert time.perf_counter() - started < 0.2
    side.synchronize()
    assert int(buffer.min()) == 3
    backend.close()
    assert backend.registered_bytes == 0
    assert not buffer.is_pinned()
    assert int(buffer[-1]) == 3  # the memory outlives the registration


@gpu
def test_a_backend_gives_one_backend_per_device() -> None:
    backend = CudaCopyBackend(0, staging_bytes=2**20)
    try:
        assert backend.for_device(torch.device("cuda", 0)) is backend
        assert backend.for_device(torch.device("cuda")) is backend
        with pytest.raises(TransferError, match="pools on cpu"):
            backend.for_device(torch.device("cpu"))
        if torch.cuda.device_count() < 2:
            return
        other = backend.for_device(torch.device("cuda", 1))
        assert other is backend.for_device(torch.device("cuda", 1))
        assert other.device == torch.device("cuda", 1)
        assert other._staging[Direction.LOAD].device == torch.device("cuda", 1)
        src = torch.arange(8 * 64, dtype=torch.int64, device="cuda:1").view(torch.uint8).view(8, -1)
        host = other.alloc_host(src.numel()).view(8, -1)
        copy = RowCopy(src, Rows.of([5, 1, 7]), host, Rows.of([0, 1, 2]))
        copy_layers_blocking(other, Direction.BACKUP, [(copy, [0])])
        assert torch.equal(host[:3], src[[5, 1, 7]].cpu())
    finally:
        backend.close()


@gpu
def test_embedded_binds_the_backend_to_the_pools_device_and_refuses_others() -> None:

    layer_map, geometry = tiny_layout()
    cuda_pool = DevicePool.allocate(geometry, 4, "cuda")
    with pytest.raises(
        ConfigError, match=r"device pools on cuda:0, but the copy backend copies on cpu"
    ):
        by_key.embedded(
            layer_map,
            dtype=torch.float16,
            page_size_tokens=4,
            host_capacity_bytes=2**20,
            device_pools={geometry.name: cuda_pool},
        )
    backend = CudaCopyBackend(0, staging_bytes=2**20)
    with pytest.raises(
        ConfigError, match=r"device pools on cpu, but the copy backend copies on cuda:0"
    ):
        by_key.embedded(
            layer_map,
            dtype=torch.float16,
            page_size_tokens=4,
            host_capacity_bytes=2**20,
            backend=backend,
            device_pools={geometry.name: DevicePool.allocate(geometry, 4)},
        )  # the build closes the backend it was given when it fails


def test_a_collection_inside_get_never_deadlocks_the_cache() -> None:
    """A weak-reference callback can run inside a garbage-collection pass set off by an
    allocation in `get` (index tensors freed only through a reference cycle, as a stopped
    walk's traceback makes them), on the same thread: it must not wait for the lock `get`
    holds."""
    import gc
    import itertools
    import threading
    import time

    cache = UploadCache(lambda t: t.clone(), capacity=256)
    done = [0]
    stop = threading.Event()

    def worker() -> None:
        class Holder:
            index: torch.Tensor
            me: object

        while not stop.is_set():
            holder = Holder()
            holder.index = torch.empty(1)
            holder.me = holder  # a cycle: only the collector frees it
            cache.get("load", holder.index)
            del holder
            done[0] += 1

    threshold = gc.get_threshold()
    gc.set_threshold(50)
    try:
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        progress = []
        for _ in range(6):
            time.sleep(0.25)
            progress.append(done[0])
        stop.set()
        for t in threads:
            t.join(timeout=5)
        assert not any(t.is_alive() for t in threads), "a thread is stuck in the cache"
        assert all(b > a for a, b in itertools.pairwise(progress)), progress
    finally:
        gc.set_threshold(*threshold)
    gc.collect()
    assert len(cache) <= 256
