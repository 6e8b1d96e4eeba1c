"""A hybrid model's side pools through hicache's storage backend (v2), driven by SGLang
0.5.23's own `HybridCacheController` and `HostPoolGroup` (no engine: SGLang's CPU engine cannot
run a hybrid forward, docs/design.md) against real `hicache serve`s of the same tiny models
(`hybrid_harness`): a Qwen3-Next (a `MambaPoolHost` beside the KV host pool) and a gpt-oss (an
SWA host pool of its sliding layers beside it).

Two SGLang processes (`window_driver.py`, a superset of `hybrid_driver.py`; one with SGLang's
default host allocator, one with its "shm" memfds) share one sidecar per model. What is
judged: after device -> host -> hicache -> (host and device cleared) -> prefetch -> host ->
device, the KV pages and the Mamba state (the SWA window's pages) are byte-exact; what one
process stored, the other hits; where a state or a window page is absent the restorable prefix
is the longest length every pool serves (SGLang's hit policies: the KV run, the state at its
trailing page, the window's trailing pages), and a state damaged in L3 is a miss, never wrong
bytes, after which the prefix shortens to the next stored state — never an exception into
SGLang.

SGLang comes from `.venv-sglang` or `$SGLANG_TEST_PYTHON`; without it this module skips.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hicache.client.process import SidecarProcess
from tests.integrations.sglang.hybrid_harness import (
    PAGE,
    HybridControllers,
    write_hybrid_deployment,
)
from tests.integrations.sglang.sglang_env import require_sglang

ALLOCATORS = {"a": "default", "b": "shm"}


@dataclass
class Setup:
    deploy: Path
    sidecar: SidecarProcess
    a: HybridControllers
    b: HybridControllers
    swa_sidecar: SidecarProcess

    def restart_sidecar(self) -> None:
        self.sidecar = SidecarProcess(self.deploy).start()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    require_sglang()
    work = tmp_path_factory.mktemp("sglang-hybrid")
    deploy = write_hybrid_deployment(work / "sidecar")
    swa_deploy = write_hybrid_deployment(work / "swa-sidecar", "gpt_oss")
    a, b = HybridControllers(work, "a"), HybridControllers(work, "b")  # import side by side
    s = Setup(deploy, SidecarProcess(deploy).start(), a, b, SidecarProcess(swa_deploy).start())
    try:
        extra = {"config": str(deploy), "retry_after_s": 0.2, "load_timeout_s": 30}
        for name, controllers in (("a", a), ("b", b)):
            started = controllers.ready().start("c", ALLOCATORS[name], extra)
            assert started == {
                "attached": True,
                "refused": None,
                "side_pools": {},
                "state_group": "linear",
            }, started
            window = controllers.start_window("w", extra | {"config": str(swa_deploy)})
            assert window == {
                "attached": True,
                "refused": None,
                "side_pools": {},
                "swa_group": "sliding",
            }, window
        yield s
    finally:
        a.close()
        b.close()
        s.sidecar.stop()
        s.swa_sidecar.stop()


def test_a_hybrid_model_without_its_mamba_pool_mapped_is_not_attached(setup: Setup) -> None:
    """Every group of the layout must be registered: no Mamba pool, or one that does not fit
    the state group, leaves the backend unattached (SGLang recomputes), saying why."""
    extra = {"config": str(setup.deploy)}
    kv_only = setup.a.start("kv-only", "default", extra, "kv_only")
    assert kv_only["attached"] is False
    assert kv_only["refused"] == (
        "the sidecar's layout has groups ['linear'] no SGLang host pool hicache maps was "
        "registered for (none registered)"
    )
    wrong = setup.a.start("bf16", "default", extra, "bf16_state")
    assert wrong["attached"] is False
    assert wrong["side_pools"] == {
        "mamba": "SGLang's Mamba host pool does not match the sidecar's group 'linear': "
        "recurrent state: SGLang (4, 32, 32) x torch.bfloat16 (8192 bytes per layer), sidecar "
        "(4, 32, 32) x torch.float32 (16384 bytes)"
    }
    assert "no SGLang host pool hicache maps was registered for ({'mamba': " in wrong["refused"]
    # an unattached backend answers "absent" / "not stored": nothing raises into SGLang
    assert setup.a.fill("kv-only", 50, 2, state=False)["backed_up_tokens"] == 0
    assert setup.a.fetch("bf16", 50, 2)["hit_pages"] == 0


def test_the_data_path_waits_for_every_host_pool_and_never_remaps_a_live_session(
    setup: Setup,
) -> None:
    """SGLang starts its storage threads before it registers the v2 pools: until
    `on_host_pools_registered` every call answers "absent" / "not stored" without attaching
    (a KV-only manifest would be refused and count an outage). A side pool registered again at
    run time is not shared anew (that would move the pools onto a new memfd under the live
    session) and is no longer served. After close(), nothing is (review F9)."""
    extra = {"config": str(setup.deploy), "retry_after_s": 0.2, "load_timeout_s": 30}
    assert setup.a.start("gate", "default", extra)["attached"] is True
    got = setup.a.attach_order("gate")
    nothing = {
        "set": [False, False],
        "get": [False, False],
        "exists": 0,
        "set_v2": {"mamba": [False]},
        "get_v2": {"mamba": [False]},
        "exists_v2": [0, []],
    }
    for step in ("kv_registered", "mamba_registered"):
        assert got[step] == nothing | {"connects": 0, "outages": 0}, step
    assert got["ready"]["set"] == [True, True]  # attached on registration, then stored
    assert got["ready"]["get"] == [True, True]
    assert got["ready"]["set_v2"] == {"mamba": [True]}
    assert got["ready"]["exists_v2"] == [2, [2]]
    assert (got["ready"]["connects"], got["ready"]["outages"]) == (1, 0)
    again = got["registered_again"]
    assert again["same_memfd"] is True
    assert again["side_pools"] == {
        "mamba": "registered after the host pools were attached (at run time); hicache maps "
        "side pools at attach only"
    }
    assert again["set"] == [True, True]  # the KV pool is still SGLang's: served
    assert (again["set_v2"], again["get_v2"]) == ({"mamba": [False]}, {"mamba": [False]})
    assert again["exists_v2"] == [0, []]
    assert got["closed"] == nothing | {"connects": 1, "outages": 0}


def whole(pages: int) -> dict[str, object]:
    """A fetch of `pages` pages, KV and the state after them, restored byte-exact."""
    return {
        "hit_pages": pages,
        "restorable": [pages],
        "fetched_tokens": pages * PAGE,
        "state_fetched": 1,
        "kv_match": True,
        "state_from": pages,
    }


def test_kv_pages_and_the_mamba_state_round_trip_byte_exact(setup: Setup) -> None:
    filled = setup.a.fill("c", 10, 8)
    assert filled == {"l1_l2_ok": True, "backed_up_tokens": 8 * PAGE, "state_stored": 1}
    assert setup.a.fetch("c", 10, 8) == whole(8)  # host and device were cleared after the fill
    # idempotent: the same prompt backed up again is stored, and fetched the same
    assert setup.a.fill("c", 10, 8)["state_stored"] == 1
    assert setup.a.fetch("c", 10, 8) == whole(8)
    never = setup.a.fetch("c", 99, 8)
    assert (never["hit_pages"], never["restorable"]) == (0, [])


def test_a_second_process_hits_what_the_first_stored(setup: Setup) -> None:
    assert setup.a.fill("c", 20, 6)["state_stored"] == 1
    assert setup.b.fetch("c", 20, 6) == whole(6)  # b's host pools are SGLang's shm memfds
    assert setup.b.fill("c", 21, 5)["state_stored"] == 1
    assert setup.a.fetch("c", 21, 5) == whole(5)


def test_three_controller_threads_use_one_backend_at_once(setup: Setup) -> None:
    """SGLang's prefetch, prefetch IO and backup threads call the v2 methods of one backend at
    once (issue #33's contract): every call answers right, none raises (review F12)."""
    assert setup.a.fill("c", 25, 4)["state_stored"] == 1
    got = setup.a.three_threads("c", 25, 4, 20)
    assert got == {"errors": [], "exists": 20, "store": 20, "load": 20}


def test_the_restorable_prefix_ends_where_every_pool_is_served(setup: Setup) -> None:
    """States after 4 and 8 pages; KV stored for 12 (its last backup without the state): a
    12-page prompt restores 8 pages with the state after 8, a 6-page one 4 pages."""
    assert setup.a.fill("c", 30, 4)["state_stored"] == 1
    assert setup.a.fill("c", 30, 8)["state_stored"] == 1
    assert setup.a.fill("c", 30, 12, state=False)["backed_up_tokens"] == 12 * PAGE
    got = setup.b.fetch("c", 30, 12)
    assert got == whole(8) | {"restorable": [4, 8]}
    assert setup.b.fetch("c", 30, 6) == whole(4)


def _state_objects(setup: Setup) -> list[Path]:
    """The file L3's state snapshots: larger than a KV page (~35 KiB to ~16 KiB here)."""
    sizes = {path: path.stat().st_size for path in (setup.deploy.parent / "l3").rglob("*.kv")}
    assert len(set(sizes.values())) == 2, sorted(set(sizes.values()))
    return [path for path, size in sizes.items() if size == max(sizes.values())]


def test_a_state_damaged_in_l3_is_a_miss_and_the_prefix_shortens(setup: Setup) -> None:
    assert setup.a.fill("c", 40, 4)["state_stored"] == 1
    assert setup.a.fill("c", 40, 8)["state_stored"] == 1
    assert setup.sidecar.stop() == 0  # SIGTERM: the drain writes what L3 still lacks
    for path in _state_objects(setup):  # every state in L3 damaged, the KV pages intact
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    setup.restart_sidecar()  # L2 empty: everything comes from L3
    got = setup.b.fetch("c", 40, 8)
    # L3 holds both states (so the query restores 8 pages); the state after 8 fails its
    # check on read: no state is loaded, never damaged bytes (the KV pages are fine)
    assert got["restorable"] == [4, 8], got
    assert (got["state_fetched"], got["state_from"], got["kv_match"]) == (0, None, True)
    # that state is known damaged now: the prefix shortens to the state after 4 (damaged too)
    again = setup.b.fetch("c", 40, 8)
    assert (again["restorable"], again["state_fetched"], again["state_from"]) == ([4], 0, None)
    assert setup.b.fetch("c", 40, 8)["restorable"] == []
    # SGLang's controller carries on: what is stored from now on is served
    assert setup.a.fill("c", 41, 8)["state_stored"] == 1
    assert setup.b.fetch("c", 41, 8) == whole(8)


def whole_window(pages: int, window: int = 4) -> dict[str, object]:
    """A fetch of `pages` pages, KV and the SWA window's last pages, restored byte-exact."""
    return {
        "hit_pages": pages,
        "restorable": [pages],
        "fetched_tokens": pages * PAGE,
        "window_fetched": window,
        "kv_match": True,
        "window_match": True,
    }


def test_an_swa_window_round_trips_and_a_second_process_hits_it(setup: Setup) -> None:
    """gpt-oss (sliding window 64 tokens: 4 pages): the window's pages travel in SGLang's SWA
    side pool, stored by their trailing keys in the sidecar's sliding group."""
    filled = setup.a.fill_window("w", 60, 8, 4)
    assert filled == {"l1_l2_ok": True, "backed_up_tokens": 8 * PAGE, "window_stored": 4}
    assert setup.a.fetch_window("w", 60, 8) == whole_window(8)
    assert setup.b.fetch_window("w", 60, 8) == whole_window(8)  # b's host pools: shm memfds


def test_an_swa_window_short_of_a_page_shortens_the_prefix(setup: Setup) -> None:
    """Windows of 4 pages stored after 4 pages, only the last 2 after 8: a length is
    restorable where its 4 trailing pages (fewer at the start) are all held."""
    assert setup.a.fill_window("w", 61, 4, 4)["window_stored"] == 4
    assert setup.a.fill_window("w", 61, 8, 2)["window_stored"] == 2
    got = setup.b.fetch_window("w", 61, 8)
    assert got == whole_window(4) | {"restorable": [1, 2, 3, 4]}


def test_an_swa_window_wider_than_the_sidecar_s_is_a_miss_never_unwritten_slots(
    setup: Setup,
) -> None:
    """SGLang's window one page wider than the layout's 4 (its `swa_retain_window`, widened
    under speculative decoding): the sidecar's sliding rule keeps only the last 4 of its 5
    pages, so the window is a miss — no restorable length, and a get of it answers False,
    writing nothing — never True over a host slot the sidecar did not write (review F1)."""
    assert setup.a.fill_window("w", 62, 4, 4)["window_stored"] == 4
    assert setup.a.fill_window("w", 62, 8, 4)["window_stored"] == 4
    served = setup.b.fetch_window("w", 62, 8)  # the layout's window: served, every length
    assert served == whole_window(8) | {"restorable": list(range(1, 9))}
    wide = setup.b.fetch_window("w", 62, 8, window=5)
    assert (wide["hit_pages"], wide["restorable"], wide["window_fetched"]) == (0, [], 0), wide
    assert setup.b.get_window("w", 62, 8, 5) == {"result": [False] * 5, "unwritten_pages": 5}
    assert setup.b.get_window("w", 62, 8, 4) == {"result": [True] * 4, "unwritten_pages": 0}


@pytest.mark.parametrize("name", ["c", "w"])
def test_transfers_sglang_should_not_send_are_misses_never_exceptions(
    setup: Setup, name: str
) -> None:
    got = setup.a.malformed(name)
    results = {
        "mamba": [{"mamba": [False]}, {"mamba": [False, False]}],
        "swa": [{"swa": [False]}, {"swa": [False]}],
        "indexer": [{"indexer": [False]}],
        "none": [{"mamba": []}],
    }
    expected = [*results["mamba"], *results["swa"], *results["indexer"], *results["none"]]
    assert got["get"] == expected
    assert got["set"] == expected
    assert got["exists_unmapped"] == [0, []]
    assert got["exists_empty"] == [0, []]
