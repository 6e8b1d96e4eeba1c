"""hicache as SGLang's HiCache storage backend for an MLA model (DeepSeek-V3's family), driven
by SGLang 0.5.23's own `HiCacheController`, `MLATokenToKVPool` and `MLATokenToKVPoolHost`
(built as SGLang's pool assembler builds them) against a real `hicache serve` at TP 2.

Two SGLang processes play TP ranks 0 and 1 of one engine. What is judged: rank 0's latents go
device -> host -> hicache -> (host and device cleared) -> hicache -> host -> device byte-exact
in both CPU host layouts; rank 1's prefetch hits what rank 0 stored and gets the same bytes
(an MLA latent is the same on every rank: SGLang backs it up from rank 0 only, and the sidecar
keys an MLA group as rank 0 on every rank, `cache.keyers`) right after rank 0's backup was
acknowledged, even after rank 1 was told "absent" for it; a prompt never stored is a miss.

SGLang comes from `.venv-sglang` (`python3 dev.py setup --sglang-kernel DIR`) or
`$SGLANG_TEST_PYTHON`; without it this module skips (fails under `_HICACHE_REQUIRE_SGLANG`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hicache.client.process import SidecarProcess
from tests.integrations.sglang.controller_harness import (
    MLA_CONFIG,
    PAGE,
    Controllers,
    write_deployment,
)
from tests.integrations.sglang.sglang_env import require_sglang

PAGES = 8
LAYOUTS = ("layer_first", "page_first_direct")  # the host layouts SGLang's CPU path copies


@dataclass
class Ranks:
    deploy: Path
    rank0: Controllers
    rank1: Controllers


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ranks]:
    require_sglang()
    work = tmp_path_factory.mktemp("sglang-mla")
    deploy = write_deployment(work / "sidecar", config=MLA_CONFIG, tp_size=2)
    extra = {"config": str(deploy), "retry_after_s": 0.2, "load_timeout_s": 30}
    with SidecarProcess(deploy):
        rank0 = Controllers(work, "rank0", tp=(0, 2))
        rank1 = Controllers(work, "rank1", tp=(1, 2))
        try:
            rank0.ready()
            rank1.ready()
            for layout in LAYOUTS:
                for rank in (rank0, rank1):
                    started = rank.start(layout, layout, extra, model="mla")
                    assert started["attached"], started
            yield Ranks(deploy, rank0, rank1)
        finally:
            rank0.close()
            rank1.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_latents_go_device_host_hicache_and_back_byte_exact(ranks: Ranks, layout: str) -> None:
    seed = 10 + LAYOUTS.index(layout)
    filled = ranks.rank0.fill(layout, seed, PAGES)
    assert filled == {"l1_l2_ok": True, "backed_up_tokens": PAGES * PAGE}
    got = ranks.rank0.fetch(layout, seed, PAGES)  # host and device were cleared after the fill
    assert got == {"hit_pages": PAGES, "fetched_tokens": PAGES * PAGE, "match": True}
    assert ranks.rank0.fetch(layout, 99, PAGES)["hit_pages"] == 0  # never stored: no hit


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_tp_rank_hits_the_latents_rank_0_stored(ranks: Ranks, layout: str) -> None:
    """In SGLang's order: every rank queries a new prompt (a miss: rank 1's sidecar
    namespace remembers L3's "absent"), rank 0 computes and backs it up (answered once L3
    holds the latents: `persisted_within_s`), the next request's query on rank 1 hits.
    Acknowledged at L2 with L3 behind, rank 1 missed under load (CI, stop 41)."""
    seed = 30 + LAYOUTS.index(layout)
    assert ranks.rank1.fetch(layout, seed, PAGES)["hit_pages"] == 0
    assert ranks.rank0.fill(layout, seed, PAGES)["backed_up_tokens"] == PAGES * PAGE
    got = ranks.rank1.fetch(layout, seed, PAGES)
    assert got == {"hit_pages": PAGES, "fetched_tokens": PAGES * PAGE, "match": True}
    assert ranks.rank1.stats(layout)["totals"]["backup_pages"] == 0  # rank 1 stores nothing
