"""hicache as SGLang's `UnifiedCacheLinker`, in real `sglang.Engine` processes (CPU, the tiny
Qwen2) attached to one real `hicache serve` at the same time, and a reference engine without
hicache: the second engine's first request of a prompt only the first computed is served from
the sidecar (`cached_tokens` >= 95% of its prefix) with greedy output equal to the reference's;
after SGLang's own cache is flushed an engine hits its own pages again; one engine killed in
the middle of a load (its forward waiting on layers the sidecar is copying) takes only its own
load (started in the sidecar, never released) and its session with it while the other keeps
hitting, and the sidecar is left with nothing pinned or reserved.

The three engines start at once and serve the whole module (start dominates: 12-46 s each).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.client.process import SidecarProcess
from tests.integrations.sglang.engine_harness import SglangEngine, require_sglang, tiny_model

PAGE = 16
PREFIX = 12 * PAGE  # a prompt's cacheable prefix: SGLang keys whole pages
LINKER_PAUSE = "hicache.integrations.sglang.linker:HicacheLinker.start_layer_wise_loading"


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(PREFIX + 5)]


def linker_args(deploy: Path) -> dict[str, Any]:
    return {
        "enable_unified_cache_external_linker": True,
        "unified_cache_external_linker_backend": "dynamic",
        "unified_cache_external_linker_config": {
            "linker": "HicacheLinker",
            "linker_module_path": "hicache.integrations.sglang.linker",
            "linker_extra_config": {"config": str(deploy), "load_timeout_s": 30},
        },
    }


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang-linker")


@pytest.fixture(scope="module")
def model(work: Path) -> Path:
    return tiny_model(require_sglang(), work / "qwen2")


@pytest.fixture(scope="module")
def deploy(work: Path, model: Path) -> Path:
    data = {
        "model": {
            "config_path": str(model / "config.json"),
            "dtype": "bfloat16",
            "page_size_tokens": PAGE,
        },
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": "64MiB"},
        "storage": {"kind": "none"},
        "service": {
            "socket_path": str(work / "engine.sock"),
            "http_host": "127.0.0.1",
            "http_port": 0,
            "heartbeat_timeout_s": 10,
        },
    }
    path = work / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def sidecar(deploy: Path) -> Iterator[SidecarProcess]:
    with SidecarProcess(deploy) as served:
        yield served


@pytest.fixture(scope="module")
def engines(
    work: Path, model: Path, deploy: Path, sidecar: SidecarProcess
) -> Iterator[dict[str, SglangEngine]]:
    """a and b: linked to the sidecar (b pauses in a load once armed); ref: no hicache."""
    pause = SglangEngine.pause_env(LINKER_PAUSE, work, "b")
    started = {
        "a": SglangEngine(work, model, engine_args=linker_args(deploy), name="a"),
        "b": SglangEngine(work, model, engine_args=linker_args(deploy), name="b", env=pause),
        "ref": SglangEngine(work, model, name="ref"),
    }
    try:
        for engine in started.values():
            engine.ready()
        yield started
    finally:
        started["b"].kill()  # paused in a load, it could not shut down
        for engine in started.values():
            engine.close()


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def namespace(sidecar: SidecarProcess) -> dict[str, Any]:
    [ns] = [n for n in sidecar.get_json("/v1/stats")["namespaces"] if "sglang" in n["namespace"]]
    found: dict[str, Any] = ns
    return found


def l2_pages(sidecar: SidecarProcess) -> int:
    pages: int = namespace(sidecar)["groups"]["full"]["l2_pages"]
    return pages


def computed(engine: SglangEngine, sidecar: SidecarProcess, tokens: list[int]) -> dict[str, Any]:
    """`engine` computes `tokens`; returns its result once the sidecar holds its pages: the
    linker offloads behind the request, on its store thread, so another engine (or this one
    after a flush) asked at once could find them still on their way."""
    before = l2_pages(sidecar)
    [result] = engine.generate([tokens])
    wait_for(
        lambda: l2_pages(sidecar) >= before + PREFIX // PAGE,
        f"{engine.name}'s pages to reach the sidecar",
    )
    return result


def quiet(ns: dict[str, Any]) -> bool:
    return all(
        g["pinned_pages"] == g["host_pinned_pages"] == g["reserved_pages"] == 0
        for g in ns["groups"].values()
    )


def test_second_engine_is_served_what_the_first_computed(
    engines: dict[str, SglangEngine], sidecar: SidecarProcess
) -> None:
    shared = prompt(1)
    [reference] = engines["ref"].generate([shared])
    first = computed(engines["a"], sidecar, shared)
    assert first["cached"] == 0
    [second] = engines["b"].generate([shared])
    assert second["cached"] >= 0.95 * PREFIX, second
    assert second["output"] == first["output"] == reference["output"]


def test_an_engine_hits_its_own_pages_after_sglang_flushed_its_cache(
    engines: dict[str, SglangEngine], sidecar: SidecarProcess
) -> None:
    own = prompt(2)
    [reference] = engines["ref"].generate([own])
    cold = computed(engines["a"], sidecar, own)
    assert engines["a"].flush_cache()
    [hit] = engines["a"].generate([own])
    assert cold["cached"] == 0
    assert hit["cached"] >= 0.95 * PREFIX, hit
    assert hit["output"] == cold["output"] == reference["output"]


def test_an_engine_killed_mid_load_leaves_the_other_hitting(
    engines: dict[str, SglangEngine], sidecar: SidecarProcess
) -> None:
    a, b = engines["a"], engines["b"]
    stored = prompt(3)
    [reference] = engines["ref"].generate([stored])
    cold = computed(a, sidecar, stored)
    assert cold["output"] == reference["output"]
    b.arm()
    b.send_generate([stored])  # b's load starts in the sidecar, its forward never comes
    wait_for(b.paused, "engine b to stop in the middle of its load")
    assert len(namespace(sidecar)["attached_sessions"]) == 2  # b holds its unreleased load

    assert a.flush_cache()
    [hit] = a.generate([stored])
    assert hit["cached"] >= 0.95 * PREFIX, hit
    assert hit["output"] == reference["output"]

    b.kill()
    assert a.flush_cache()
    [again] = a.generate([stored])
    assert again["cached"] >= 0.95 * PREFIX, again
    assert again["output"] == reference["output"]
    # b's session ends with its process: its ops are cancelled and awaited (their pins go),
    # then it leaves the namespace (`Namespace.detach`): both, the one after the other
    wait_for(
        lambda: quiet(n := namespace(sidecar)) and len(n["attached_sessions"]) == 1,
        "b's pins and session to go with it (a's session alone attached, nothing pinned)",
    )
