"""Real model math through a real sidecar: `hicache serve` in a child process, this test
process as the engine (the tiny model's forward here, its KV pool in a shared file, every
request through `hicache.client`). The same flow and judge as test_embedded_models.py: the
model continues from what the sidecar loaded exactly as from its own cache, with the expected
hit; one case per family comes back from L3 after L2 is emptied over the HTTP admin API.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from hicache.client.process import SidecarProcess
from tests.real_models.harness import (
    TOLERANCE,
    Case,
    Outcome,
    Zoo,
    make_case,
    run_sidecar,
    sidecar_deployment,
)

PAGE = 4  # the deployment's page size

# dense; sliding + full; gated delta net + full; Mamba-2 beside attention in every layer; MLA
# with the sparse indexer
FAMILIES = ["llama", "gemma3_text", "qwen3_next", "falcon_h1", "deepseek_v32"]

CASES = [
    make_case("p4_a14_extend", PAGE, 14, extend=5, hit=12),
    make_case("p4_a16_diverge10", PAGE, 16, diverge_at=10, hit=8),
    make_case("p4_a16_exact", PAGE, 16, exact=True, hit=12),
    make_case("p4_a13_exact", PAGE, 13, exact=True, hit=12),
]

SLIDING_FREED = [
    make_case(
        "p4_a24_freed01_diverge21", PAGE, 24, diverge_at=21, hit=20, freed={"sliding": (0, 1)}
    ),
    make_case(
        "p4_a24_freed01_diverge13", PAGE, 24, diverge_at=13, hit=0, freed={"sliding": (0, 1)}
    ),
]


class Sidecars:
    """One `hicache serve` per family, started on first use, stopped at the module's end."""

    def __init__(self, zoo: Zoo, directory: Path):
        self.zoo = zoo
        self.directory = directory
        self.running: dict[str, SidecarProcess] = {}
        self.failed: dict[str, BaseException] = {}  # a start that failed is not retried

    def get(self, family: str) -> SidecarProcess:
        if family in self.failed:
            raise self.failed[family]
        if family not in self.running:
            deploy = sidecar_deployment(self.zoo.get(family), self.directory / family, PAGE)
            try:
                self.running[family] = SidecarProcess(deploy).start()
            except BaseException as exc:
                self.failed[family] = exc
                raise
        return self.running[family]

    def stop(self) -> None:
        codes = {name: proc.stop() for name, proc in self.running.items()}
        logs = {name: proc.log_path.read_text()[-2000:] for name, proc in self.running.items()}
        bad = {name: code for name, code in codes.items() if code != 0}
        assert not bad, f"sidecars exited {bad}; logs: {[logs[n] for n in bad]}"


@pytest.fixture(scope="module")
def sidecars(zoo: Zoo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecars]:
    running = Sidecars(zoo, tmp_path_factory.mktemp("sc"))
    try:
        yield running
    finally:
        running.stop()


def check(out: Outcome) -> None:
    case = out.case
    assert out.lookup_tokens_total == case.expect_hit, out.message()
    assert out.loaded_tokens == case.expect_hit, out.message()
    if case.expect_hit == 0:
        assert out.diff is None, out.message()
        return
    assert out.diff is not None, out.message()
    assert out.diff <= TOLERANCE, out.message()


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_model_continues_from_the_sidecars_load_as_from_its_own_cache(
    zoo: Zoo, sidecars: Sidecars, family: str, case: Case
) -> None:
    sidecar = sidecars.get(family)
    out = run_sidecar(zoo.get(family), case, sidecar.socket, tenant=case.name)
    assert out.lookup_tokens_l2 == case.expect_hit, out.message()
    check(out)


@pytest.mark.parametrize("case", SLIDING_FREED, ids=str)
def test_freed_sliding_pages_shorten_the_sidecars_hit(
    zoo: Zoo, sidecars: Sidecars, case: Case
) -> None:
    sidecar = sidecars.get("gemma3_text")
    out = run_sidecar(zoo.get("gemma3_text"), case, sidecar.socket, tenant=case.name)
    check(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_loaded_from_the_sidecars_l3_after_l2_is_emptied(
    zoo: Zoo, sidecars: Sidecars, family: str
) -> None:
    sidecar = sidecars.get(family)

    def clear_l2() -> None:
        # L3 is written behind the acked store: wait until nothing is queued or being written
        deadline = time.monotonic() + 120  # bounds a hang only (#26: a busy machine)
        while time.monotonic() < deadline:
            with urllib.request.urlopen(sidecar.http + "/v1/stats", timeout=10) as reply:
                stats = json.loads(reply.read())
            busy = [
                ns["persist"]["queued_pages"]
                + ns["persist"]["writing_pages"]
                + sum(g["pinned_pages"] for g in ns["groups"].values())
                for ns in stats["namespaces"]
            ]
            if not any(busy):
                break
            time.sleep(0.02)
        request = urllib.request.Request(sidecar.http + "/v1/admin/clear?tier=l2", method="POST")
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert reply.status == 200

    case = make_case("p4_a16_diverge10_l3", PAGE, 16, diverge_at=10, hit=8)
    out = run_sidecar(zoo.get(family), case, sidecar.socket, tenant=case.name, after_store=clear_l2)
    assert out.lookup_tokens_l2 == 0, out.message()
    check(out)
