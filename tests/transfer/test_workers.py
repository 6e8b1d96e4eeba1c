"""Copy workers are daemon threads closed at interpreter exit unless closed before
(`hicache/transfer/workers.py`): registration, the bounded exit close, and a worker that
outlives a raising callback. The real exits, in child processes, are in
tests/test_process_exit.py."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import pytest

from hicache.testing.fake_copies import FakeCopyBackend
from hicache.transfer import CpuCopyBackend, Direction, LayerPart, workers


class Counting(FakeCopyBackend):
    """Runs no copies: counts layers, and blocks in one while `hold` is clear."""

    def __init__(self, *, gated: bool = False):
        self.hold = threading.Event()
        self.hold.set()
        super().__init__(gated=gated)

    def _run_layer(self, direction: Direction, position: int, parts: Sequence[LayerPart]) -> None:
        self.hold.wait()
        self.layers_run += 1


def walk(layers: int) -> list[list[LayerPart]]:
    return [[object()]] * layers  # type: ignore[list-item]  # parts the fake never reads


def test_the_worker_is_a_daemon_registered_until_closed() -> None:
    backend = CpuCopyBackend(staging_bytes=1024)
    assert backend._thread.daemon
    assert backend in workers.open_owners()
    backend.close()
    assert backend not in workers.open_owners()
    assert not backend._thread.is_alive()
    backend.close()  # idempotent


def test_close_for_exit_opens_the_gate_and_finishes_queued_walks() -> None:
    backend = Counting(gated=True)
    heard: list[dict[int, BaseException]] = []
    for _ in range(2):
        backend.submit_walk(Direction.LOAD, walk(3), heard.append)
    backend.close_for_exit(5.0)
    assert heard == [{}, {}]
    assert backend.layers_run == 6
    assert not backend._thread.is_alive()
    assert backend not in workers.open_owners()


def test_close_for_exit_waits_no_longer_than_its_bound() -> None:
    backend = Counting()
    backend.hold.clear()  # the layer never ends until released
    heard: list[dict[int, BaseException]] = []
    backend.submit_walk(Direction.LOAD, walk(1), heard.append)
    started = time.monotonic()
    backend.close_for_exit(0.2)
    assert time.monotonic() - started < 2
    assert backend._thread.is_alive()  # left to the process's end
    assert not heard
    backend.hold.set()
    backend.close()  # the owner's close still joins it
    assert heard == [{}]
    assert not backend._thread.is_alive()


def test_a_raising_callback_does_not_kill_the_worker(caplog: pytest.LogCaptureFixture) -> None:
    backend = Counting()
    heard: list[dict[int, BaseException]] = []

    def bad(errors: dict[int, BaseException]) -> None:
        raise RuntimeError("the loop is gone")

    with caplog.at_level(logging.ERROR, logger="hicache.transfer"):
        backend.submit_walk(Direction.LOAD, walk(1), bad)
        backend.submit_walk(Direction.LOAD, walk(1), heard.append)
        backend.close()
    assert heard == [{}]
    assert "a walk's callback raised" in caplog.text
