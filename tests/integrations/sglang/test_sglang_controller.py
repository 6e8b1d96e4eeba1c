"""hicache as SGLang's HiCache storage backend, driven by SGLang 0.5.23's own `HiCacheController`
and `MHATokenToKVPoolHost` (no engine, no CPU kernel needed) against a real `hicache serve`.

Two SGLang processes (`controller_driver.py`, each its own controllers, as two engines would
be) share one sidecar for the whole module: the processes' imports are most of the cost. What
is judged: the bytes SGLang's controller puts back on its device after device -> host ->
hicache -> (host and device cleared) -> hicache -> host -> device equal what it stored, in both
CPU host layouts; what one process stored, the other's prefetch hits; a killed sidecar gives
misses and failed backups, never an exception into SGLang, and the link comes back with the
sidecar; a page corrupted in L3 is a miss, never wrong bytes.

SGLang comes from `.venv-sglang` (`python3 dev.py setup --sglang-kernel DIR`) or
`$SGLANG_TEST_PYTHON`; without it this module skips (fails under `_HICACHE_REQUIRE_SGLANG`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hicache.client.process import SidecarProcess
from tests.integrations.sglang.controller_harness import Controllers, write_deployment
from tests.integrations.sglang.sglang_env import require_sglang
from tests.integrations.vllm_harness import corrupt_l3

PAGES = 8  # a request of 8 pages of 16 tokens
LAYOUTS = ("layer_first", "page_first_direct")  # the host layouts SGLang's CPU path copies


@dataclass
class Setup:
    deploy: Path
    sidecar: SidecarProcess
    a: Controllers
    b: Controllers

    def extra(self) -> dict[str, object]:
        return {"config": str(self.deploy), "retry_after_s": 0.2, "load_timeout_s": 30}

    def restart_sidecar(self) -> None:
        self.sidecar = SidecarProcess(self.deploy).start()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    require_sglang()
    work = tmp_path_factory.mktemp("sglang-controller")
    deploy = write_deployment(work / "sidecar")
    sidecar = SidecarProcess(deploy).start()
    a, b = Controllers(work, "a"), Controllers(work, "b")  # import side by side
    try:
        a.ready()
        b.ready()
        s = Setup(deploy, sidecar, a, b)
        for layout in LAYOUTS:
            for controllers in (a, b):
                started = controllers.start(layout, layout, s.extra())
                assert started["attached"], started
        yield s
    finally:
        a.close()
        b.close()
        s.sidecar.stop() if "s" in locals() else sidecar.stop()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_host_hicache_and_back_is_byte_exact(setup: Setup, layout: str) -> None:
    seed = 10 + LAYOUTS.index(layout)
    filled = setup.a.fill(layout, seed, PAGES)
    assert filled == {"l1_l2_ok": True, "backed_up_tokens": PAGES * 16}
    got = setup.a.fetch(layout, seed, PAGES)  # host and device were cleared after the fill
    assert got == {"hit_pages": PAGES, "fetched_tokens": PAGES * 16, "match": True}
    assert setup.a.fetch(layout, 99, PAGES)["hit_pages"] == 0  # never stored: no hit
    stats = setup.a.stats(layout)
    assert stats["totals"]["backup_pages"] == PAGES
    assert stats["totals"]["prefetch_pages"] == PAGES
    # SGLang's metrics get the pages each prefetch and backup moved
    assert stats["metrics_prefetch_pgs"] == [PAGES]
    assert stats["metrics_backup_pgs"] == [PAGES]


def test_the_host_layouts_share_pages(setup: Setup) -> None:
    """layer_first and page_first_direct hold the same bytes per page row: one tenant."""
    assert setup.a.fill("layer_first", 20, PAGES)["backed_up_tokens"] == PAGES * 16
    got = setup.a.fetch("page_first_direct", 20, PAGES)
    assert got == {"hit_pages": PAGES, "fetched_tokens": PAGES * 16, "match": True}


def test_a_second_process_hits_what_the_first_stored(setup: Setup) -> None:
    for layout in LAYOUTS:
        seed = 30 + LAYOUTS.index(layout)
        assert setup.a.fill(layout, seed, PAGES)["backed_up_tokens"] == PAGES * 16
        got = setup.b.fetch(layout, seed, PAGES)
        assert got == {"hit_pages": PAGES, "fetched_tokens": PAGES * 16, "match": True}
    # a prefix of what was stored hits as far as it goes
    assert setup.b.fetch("layer_first", 30, PAGES // 2)["fetched_tokens"] == PAGES * 8


def _l3_objects(setup: Setup) -> int:
    return sum(1 for _ in (setup.deploy.parent / "l3").rglob("*.kv"))


def test_a_page_corrupted_in_l3_is_a_miss(setup: Setup) -> None:
    before = _l3_objects(setup)
    assert setup.a.fill("layer_first", 40, PAGES)["backed_up_tokens"] == PAGES * 16
    assert setup.sidecar.stop() == 0  # SIGTERM: the drain writes what L3 still lacks
    assert _l3_objects(setup) >= before + PAGES
    assert corrupt_l3(setup.deploy.parent / "l3") >= PAGES
    setup.restart_sidecar()  # L2 empty: everything comes from the (corrupted) L3
    got = setup.b.fetch("layer_first", 40, PAGES)
    assert got["fetched_tokens"] == 0, got  # verified on read: a miss, never wrong bytes
    assert got["match"] is None
    # SGLang's controller carries on: what is stored from now on is served
    assert setup.a.fill("layer_first", 41, PAGES)["backed_up_tokens"] == PAGES * 16
    assert setup.b.fetch("layer_first", 41, PAGES)["match"] is True


def test_a_killed_sidecar_makes_sglang_recompute_never_crash(setup: Setup) -> None:
    assert setup.a.fill("page_first_direct", 50, PAGES)["backed_up_tokens"] == PAGES * 16
    setup.sidecar.stop(signal.SIGKILL)
    # every call answers "absent" / "not stored": SGLang recomputes, nothing raises
    assert setup.b.fetch("page_first_direct", 50, PAGES) == {
        "hit_pages": 0,
        "fetched_tokens": 0,
        "match": None,
    }
    assert setup.a.fill("page_first_direct", 51, PAGES)["backed_up_tokens"] == 0
    assert setup.a.stats("page_first_direct")["link"]["outages"] >= 1
    setup.restart_sidecar()
    # the link retries every retry_after_s (0.2 s): the first fill after that stores again
    deadline = time.monotonic() + 60
    while (stored := setup.a.fill("page_first_direct", 52, PAGES)["backed_up_tokens"]) == 0:
        assert time.monotonic() < deadline, "the backend never reattached to the new sidecar"
    assert stored == PAGES * 16
    got = setup.b.fetch("page_first_direct", 52, PAGES)
    assert got == {"hit_pages": PAGES, "fetched_tokens": PAGES * 16, "match": True}
