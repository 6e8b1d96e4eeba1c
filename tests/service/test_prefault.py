"""Page tables ahead of the hot path (`hicache/channel/prefault.py`): an engine's pool is
allocated and mapped before it is registered, the sidecar fills its own page tables for the
pages the engine allocated (and only those), and a copy through either mapping then takes no
page fault. Faults are counted by the kernel for this thread (`RUSAGE_THREAD`), not timed:
the same verdict on a busy machine. The detectors (a fresh mapping, an unprefaulted pool)
show one fault per page written, so the counts can fail."""

from __future__ import annotations

import asyncio
import mmap
import os
import resource
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy
import pytest
import torch

from hicache.channel.prefault import allocated_extents, populate
from hicache.channel.shm import SharedPools, map_fd, map_peer_fd, sealed_memfd
from hicache.memory import CacheDtypes, GroupGeometry
from hicache.model import LayerMap, load_layout
from hicache.service.sessions import Prefaulting
from tests.conftest import shared_model

PAGE = mmap.PAGESIZE


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


# Faults a fill may take outside the buffer it writes: a stack page its call touches first, a
# code page on first use, the kernel's own reclaim or huge-page work unmapping a page of this
# process. A fresh run of the whole suite on an idle machine once counted 1 where 0 was
# asserted (2026-12-06). Every buffer checked here spans at least 10 pages, and an unprefaulted
# one faults once per page written (the detectors), so the checks still fail where it matters.
FOREIGN_FAULTS = 2


def _write_faults(tensor: torch.Tensor) -> int:
    """Minor faults this thread takes writing every byte of `tensor` once (numpy's fill, on
    this thread alone: torch would split it over threads the count does not see). The same
    fill runs first on a scratch array of the same dtype, so the count is of `tensor`'s
    pages, not of the fill's first use."""
    array = tensor.numpy()
    scratch = numpy.zeros(PAGE, dtype=array.dtype)
    scratch.fill(1)
    before = _faults()
    array.fill(1)
    return _faults() - before


def _prefaulted(tensor: torch.Tensor) -> bool:
    """Writing every page of `tensor` faults no page of it (at most `FOREIGN_FAULTS`)."""
    assert tensor.numel() >= 10 * PAGE  # an unprefaulted buffer would exceed the allowance
    return _write_faults(tensor) <= FOREIGN_FAULTS


def _memfd(nbytes: int) -> int:
    return sealed_memfd("hicache-test", nbytes)


def test_allocated_extents_are_the_written_pages_only() -> None:
    fd = _memfd(64 * PAGE)
    try:
        assert allocated_extents(fd, 64 * PAGE) == []
        view = map_fd(fd, 64 * PAGE)
        view[3 * PAGE + 10] = 1  # page 3
        view[10 * PAGE : 13 * PAGE] = 2  # pages 10..12
        view[63 * PAGE] = 3  # the last page
        assert allocated_extents(fd, 64 * PAGE) == [
            (3 * PAGE, 4 * PAGE),
            (10 * PAGE, 13 * PAGE),
            (63 * PAGE, 64 * PAGE),
        ]
        # looked for on the sidecar's loop: a scattered file is cut short, never scanned whole
        assert allocated_extents(fd, 64 * PAGE, max_extents=2) == [
            (3 * PAGE, 4 * PAGE),
            (10 * PAGE, 13 * PAGE),
        ]
    finally:
        os.close(fd)


def test_a_write_populate_allocates_every_page_zeroed_and_keeps_written_bytes() -> None:
    fd = _memfd(256 * PAGE)
    try:
        view = map_fd(fd, 256 * PAGE)
        view[5 * PAGE : 6 * PAGE] = 9
        assert populate(view.data_ptr(), 256 * PAGE, write=True) == 256 * PAGE
        assert allocated_extents(fd, 256 * PAGE) == [(0, 256 * PAGE)]
        assert view[5 * PAGE : 6 * PAGE].eq(9).all()  # nothing written by the populate
        assert int(view.sum()) == 9 * PAGE  # every other byte is still zero
        assert _prefaulted(view)
    finally:
        os.close(fd)


def test_a_fresh_mapping_faults_once_per_page_written_a_populated_one_never() -> None:
    pages = 512
    fd = _memfd(pages * PAGE)
    try:
        first = map_fd(fd, pages * PAGE)
        populate(first.data_ptr(), pages * PAGE, write=True)
        # the detector: another mapping of the same (allocated) pages faults on each write
        assert _write_faults(map_fd(fd, pages * PAGE)) >= pages
        # a read populate maps shmem pages writable: the writes after it take no fault
        again = map_fd(fd, pages * PAGE)
        populate(again.data_ptr(), pages * PAGE, write=False)
        assert _prefaulted(again)
    finally:
        os.close(fd)


def test_populate_stops_between_chunks_and_refuses_an_unaligned_address() -> None:
    fd = _memfd(4 * PAGE)
    try:
        view = map_fd(fd, 4 * PAGE)
        stop = threading.Event()
        stop.set()
        assert populate(view.data_ptr(), 4 * PAGE, write=True, stop=stop) == 0
        assert allocated_extents(fd, 4 * PAGE) == []
        with pytest.raises(ValueError, match=r"^populate: address 0x[0-9a-f]+ is not 4096-byte"):
            populate(view.data_ptr() + 1, PAGE, write=True)
    finally:
        os.close(fd)


def _geometries() -> dict[str, GroupGeometry]:
    layer_map = LayerMap(load_layout(shared_model("llama-3.1-8b.json")))
    dtypes = CacheDtypes.from_names("bfloat16", None, None)
    return {g.name: GroupGeometry.of(g, dtypes, 16) for g in layer_map.groups}


def test_an_engine_pool_is_allocated_at_creation_a_staging_pool_on_first_use() -> None:
    geometries = _geometries()
    pools = SharedPools.create(geometries, 4)
    staging = SharedPools.create(geometries, 4, prefault=False)
    try:
        assert allocated_extents(pools.fd, pools.nbytes) == [(0, pools.nbytes)]
        assert _prefaulted(pools.buffer)
        assert allocated_extents(staging.fd, staging.nbytes) == []
    finally:
        pools.close()
        staging.close()


def test_the_sidecar_prefaults_what_the_engine_allocated_and_nothing_more() -> None:
    """The sidecar's mapping of an engine's memfd (`map_peer_fd`, this process as the
    engine): the allocated pages are prefaulted, so a load's writes into them fault no more;
    the holes stay holes."""
    pages = 256
    fd = _memfd(pages * PAGE)
    try:
        engine = map_fd(fd, pages * PAGE)
        engine[: 100 * PAGE] = 1  # the engine wrote pages 0..99
        engine[200 * PAGE : 210 * PAGE] = 1  # and 200..209
        memory = map_peer_fd(os.getpid(), fd, pages * PAGE, "fd")
        assert memory.allocated == ((0, 100 * PAGE), (200 * PAGE, 210 * PAGE))
        assert memory.prefault() == 110 * PAGE
        assert allocated_extents(fd, pages * PAGE) == [(0, 100 * PAGE), (200 * PAGE, 210 * PAGE)]
        assert _prefaulted(memory.tensor[: 100 * PAGE])
        assert _prefaulted(memory.tensor[200 * PAGE : 210 * PAGE])
    finally:
        os.close(fd)


@pytest.mark.asyncio
async def test_a_session_end_stops_its_prefault_and_waits_for_the_thread() -> None:
    fd = _memfd(1024 * PAGE)
    try:
        engine = map_fd(fd, 1024 * PAGE)
        populate(engine.data_ptr(), 1024 * PAGE, write=True)
        memory = map_peer_fd(os.getpid(), fd, 1024 * PAGE, "fd")
        with ThreadPoolExecutor(1) as executor:
            async with asyncio.TaskGroup() as tg:
                # one prefault holds the thread; the next waits in its queue and is stopped
                # there: its session's end never waits for another session's prefault
                gate = threading.Event()
                executor.submit(gate.wait)
                queued = Prefaulting.start(tg, executor, memory, session=2, pid=os.getpid())
                await asyncio.sleep(0)
                await asyncio.wait_for(queued.stop(), timeout=60)
                assert queued.task.cancelled()
                gate.set()
                running = Prefaulting.start(tg, executor, memory, session=1, pid=os.getpid())
                await running.stop()
                assert running.task.done()
    finally:
        os.close(fd)
