"""A DSA model (DeepSeek-V3.2, GLM-5) through hicache's storage backend, driven by SGLang
0.5.23's own `HybridCacheController`, `DSATokenToKVPool`, `MLATokenToKVPoolHost` and
`DSAIndexerPoolHost` (SGLang's INDEXER side pool, v2) against a real `hicache serve` of a tiny
DeepSeek-V3.2 (`dsa_harness`; no engine: SGLang's DSA forward needs CUDA kernels).

Two SGLang processes (one with SGLang's default host allocator, one with its "shm" memfds)
share one sidecar. What is judged: after device -> host -> hicache -> (host and device
cleared) -> prefetch -> host -> device, the MLA latents and the indexer's fp8 keys and scales
are byte-exact in both host layouts SGLang's direct IO moves the indexer in; what one process
stored the other hits; a page damaged in L3 is a miss, latents and keys together (one object
holds both: a latent is never served beside another page's or damaged keys); a deployment whose
index is not stored as SGLang keeps it is refused at attach, naming the setting, and SGLang
then recomputes.

SGLang comes from `.venv-sglang` or `$SGLANG_TEST_PYTHON`; without it this module skips.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hicache.client.process import SidecarProcess
from tests.integrations.sglang.dsa_harness import DsaControllers, write_dsa_deployment
from tests.integrations.sglang.sglang_env import require_sglang
from tests.integrations.vllm_harness import corrupt_l3, served_loads

LAYOUTS = ("layer_first", "page_first_direct")  # SGLang's direct IO moves the indexer in these
ALLOCATORS = {"a": "default", "b": "shm"}


@dataclass
class Setup:
    work: Path
    deploy: Path
    sidecar: SidecarProcess
    a: DsaControllers
    b: DsaControllers


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    require_sglang()
    work = tmp_path_factory.mktemp("sglang-dsa")
    deploy = write_dsa_deployment(work / "sidecar")
    a, b = DsaControllers(work, "a"), DsaControllers(work, "b")  # import side by side
    s = Setup(work, deploy, SidecarProcess(deploy).start(), a, b)
    try:
        extra = {"config": str(deploy), "retry_after_s": 0.2, "load_timeout_s": 30}
        for name, controllers in (("a", a), ("b", b)):
            controllers.ready()
            for layout in LAYOUTS:
                started = controllers.start(layout, layout, ALLOCATORS[name], extra)
                assert started == {
                    "attached": True,
                    "refused": None,
                    "side_pools": {},
                    "indexer_group": "sparse",
                }, started
        yield s
    finally:
        a.close()
        b.close()
        s.sidecar.stop()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_latents_and_index_keys_round_trip_byte_exact_and_the_other_process_hits(
    setup: Setup, layout: str
) -> None:
    seed = 10 + LAYOUTS.index(layout)
    filled = setup.a.fill(layout, seed=seed, pages=4)
    assert filled == {"l1_l2_ok": True, "backed_up_tokens": 4 * 64, "indexer_stored": 4}
    loads = served_loads(setup.sidecar.get_json("/v1/stats"))
    mine = setup.a.fetch(layout, seed=seed, pages=4)
    assert mine == {"hit_pages": 4, "fetched_tokens": 256, "indexer_hits": None, "match": True}
    # one load for the batch: the INDEXER's get right after the KV's is answered from what
    # that load moved (its rows are the same pages'), not loaded twice
    assert served_loads(setup.sidecar.get_json("/v1/stats")) == loads + 1
    # the other process (SGLang's "shm" allocator), the same layout's bytes: it hits them
    theirs = setup.b.fetch(layout, seed=seed, pages=4)
    assert theirs["match"] is True, theirs
    assert theirs["fetched_tokens"] == 256
    # a longer prompt of the same seed: the stored prefix hits, the rest is SGLang's to compute
    longer = setup.b.fetch(layout, seed=seed, pages=6)
    assert (longer["hit_pages"], longer["match"]) == (4, True)
    assert setup.a.fetch(layout, seed=seed + 100, pages=2)["hit_pages"] == 0  # never stored


def test_an_index_not_stored_as_sglang_keeps_it_is_refused_by_name(setup: Setup) -> None:
    deploy = write_dsa_deployment(setup.work / "plain-sidecar", index_format="kv_dtype")
    started = setup.a.start("plain", "layer_first", "default", {"config": str(deploy)})
    assert started["attached"] is False
    assert started["side_pools"] == {
        "indexer": "the sidecar's group 'sparse' keeps index tensors ['index_k']; SGLang keeps "
        "DSA index keys as fp8 with a float32 scale per 128 dims (132 bytes a token): set "
        "model.index_format: fp8_scaled in the deployment"
    }
    assert started["refused"].startswith(
        "the sidecar's group 'sparse' keeps a DSA model's indexer keys and no SGLang DSA "
        "indexer host pool hicache maps was registered ({'indexer': "
    )
    # unattached: every call answers "absent" / "not stored", nothing raises into SGLang
    assert setup.a.fill("plain", seed=30, pages=2)["backed_up_tokens"] == 0
    assert setup.a.fetch("plain", seed=30, pages=2)["hit_pages"] == 0


def test_a_page_damaged_in_l3_is_a_miss_latents_and_keys_together(setup: Setup) -> None:
    l3 = setup.deploy.parent / "l3"
    assert setup.a.fill("page_first_direct", seed=40, pages=4)["indexer_stored"] == 4
    assert setup.sidecar.stop() == 0  # SIGTERM: the drain writes what L3 still lacks
    assert corrupt_l3(l3) >= 4
    setup.sidecar = SidecarProcess(setup.deploy).start()  # L2 empty: all from the damaged L3
    got = setup.b.fetch("page_first_direct", seed=40, pages=4)
    assert got["fetched_tokens"] == 0, got  # verified on read: a miss, never wrong bytes
    assert got["match"] is None
    # the controllers carry on: what is stored from now on is served
    assert setup.a.fill("page_first_direct", seed=41, pages=4)["backed_up_tokens"] == 256
    assert setup.b.fetch("page_first_direct", seed=41, pages=4)["match"] is True
