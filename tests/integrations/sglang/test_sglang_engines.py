"""Two real `sglang.Engine` processes (SGLang 0.5.23 on CPU, a tiny random-weight Qwen2) with
hicache as their HiCache storage backend, attached to one `hicache serve` at the same time.

Judged by SGLang itself: the second engine's first request of a prompt only the first engine
has seen reports `cached_tokens` (what SGLang loaded instead of computing) of at least 95% of
the prompt's full pages, and its greedy tokens equal the first engine's, which computed the
prompt from scratch (cached 0: a run without any cache). An engine killed in the middle of a
load (stopped in the backend's `batch_get_v1` while the sidecar's load for it is in flight,
then SIGKILLed) leaves the other one hitting, byte for byte the same tokens, and the sidecar
with no pin of the dead engine's left.

Needs SGLang and its CPU kernel (`.venv-sglang`, or `$SGLANG_TEST_PYTHON`); skips without
them (fails under `_HICACHE_REQUIRE_SGLANG`). The CPU shims for HiCache's host pools come from
`cpu_site/` (see its README).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hicache.client.process import SidecarProcess
from tests.integrations.sglang.engine_harness import SglangEngine, require_sglang, tiny_model

PAGE = 16
PROMPT_TOKENS = 200  # 12 full pages and a tail


def _deployment(directory: Path, model: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = [
        "model:",
        f"  config_path: {model / 'config.json'}",
        "  dtype: bfloat16",
        f"  page_size_tokens: {PAGE}",
        "device:",
        "  kind: cpu",
        "  pool_capacity_bytes: 16MiB",
        "host:",
        "  capacity_bytes: 64MiB",
        "storage:",
        "  kind: file",
        "  path: l3",
        "  capacity_bytes: 256MiB",
        "service:",
        "  socket_path: engine.sock",
        "  http_host: 127.0.0.1",
        "  http_port: 0",
        "  heartbeat_timeout_s: 10",
    ]
    path = directory / "deploy.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def engine_args(deploy: Path) -> dict[str, Any]:
    """SGLang's HiCache with hicache as its storage backend (what the README's launch line
    says, as `sglang.Engine` keywords). `wait_complete`: a prefetch is never cut short by
    SGLang's timeout on a busy test machine (the default `timeout` policy is for serving)."""
    return {
        "enable_hierarchical_cache": True,
        "hicache_ratio": 2.0,
        "hicache_io_backend": "direct",
        "hicache_mem_layout": "page_first_direct",
        "hicache_write_policy": "write_through",
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_storage_backend": "dynamic",
        "hicache_storage_backend_extra_config": json.dumps(
            {
                "backend_name": "hicache",
                "module_path": "hicache.integrations.sglang",
                "class_name": "HicacheStorage",
                "interface_v1": 1,
                "config": str(deploy),
                "prefetch_threshold": PAGE,
            }
        ),
    }


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)]


def full_pages(tokens: list[int]) -> int:
    """The tokens a cache may serve: whole pages of all but the last token."""
    return (len(tokens) - 1) // PAGE * PAGE


@dataclass
class Pair:
    work: Path
    sidecar: SidecarProcess
    a: SglangEngine
    b: SglangEngine

    def l2_pages(self) -> int:
        stats = self.sidecar.get_json("/v1/stats")
        return sum(
            group["l2_pages"] for ns in stats["namespaces"] for group in ns["groups"].values()
        )

    def sessions(self) -> int:
        stats = self.sidecar.get_json("/v1/stats")
        return sum(len(ns["attached_sessions"]) for ns in stats["namespaces"])

    def pinned_pages(self) -> int:
        stats = self.sidecar.get_json("/v1/stats")
        return sum(
            group["pinned_pages"] + group["host_pinned_pages"]
            for ns in stats["namespaces"]
            for group in ns["groups"].values()
        )

    def stored_by(self, engine: SglangEngine, tokens: list[int]) -> dict[str, Any]:
        """`engine` computes `tokens`; returns its result once the sidecar holds its pages
        (SGLang backs them up behind the request, on its backup thread)."""
        before = self.l2_pages()
        [result] = engine.generate([tokens])
        deadline = time.monotonic() + 120
        while self.l2_pages() < before + len(tokens) // PAGE:
            assert time.monotonic() < deadline, f"{engine.name}'s pages never reached the sidecar"
            time.sleep(0.05)  # polling the sidecar's stats: no event to wait on across processes
        return result


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    python = require_sglang()
    work = tmp_path_factory.mktemp("sglang-engines")
    model = tiny_model(python, work / "tiny-qwen2")
    deploy = _deployment(work / "sidecar", model)
    sidecar = SidecarProcess(deploy).start()
    args = engine_args(deploy)
    # b stops, once armed, where its backend waits for a load the sidecar has started
    pause = SglangEngine.pause_env("hicache.client.handle:LoadHandle.done", work, "b")
    a = SglangEngine(work, model, engine_args=args, name="a")  # both start side by side
    b = SglangEngine(work, model, engine_args=args, name="b", env=pause)
    try:
        a.ready()
        b.ready()
        yield Pair(work, sidecar, a, b)
    finally:
        a.close()
        b.close()
        sidecar.stop()


def test_the_second_engine_hits_what_only_the_first_has_seen(pair: Pair) -> None:
    tokens = prompt(1)
    cold = pair.stored_by(pair.a, tokens)
    assert cold["cached"] == 0  # computed from scratch: the reference
    [warm] = pair.b.generate([tokens])  # b has never seen it
    assert warm["cached"] >= 0.95 * full_pages(tokens), warm
    assert warm["output"] == cold["output"]
    # and the other way round, after the first engine dropped its own copies
    other = prompt(2)
    cold_b = pair.stored_by(pair.b, other)
    assert cold_b["cached"] == 0
    assert pair.a.flush_cache()
    [warm_a] = pair.a.generate([other])
    assert warm_a["cached"] >= 0.95 * full_pages(other), warm_a
    assert warm_a["output"] == cold_b["output"]


def test_an_engine_killed_mid_load_the_other_keeps_hitting(pair: Pair) -> None:
    tokens = prompt(3)
    cold = pair.stored_by(pair.a, tokens)
    pair.b.arm()  # b now stops in its next load, once the sidecar has started it
    pair.b.send_generate([tokens])
    deadline = time.monotonic() + 120
    while not pair.b.paused():
        assert time.monotonic() < deadline, "engine b never reached a load"
        time.sleep(0.05)  # the announcement is a file b writes: polled
    sessions = pair.sessions()
    pair.b.kill()
    deadline = time.monotonic() + 60
    while pair.sessions() >= sessions or pair.pinned_pages():
        assert time.monotonic() < deadline, "the dead engine's session or pins never went"
        time.sleep(0.05)
    assert pair.a.flush_cache()  # a's own copies gone: what it gets now comes from hicache
    [warm] = pair.a.generate([tokens])
    assert warm["cached"] >= 0.95 * full_pages(tokens), warm
    assert warm["output"] == cold["output"]
    fresh = prompt(4)
    cold_fresh = pair.stored_by(pair.a, fresh)
    assert pair.a.flush_cache()
    [again] = pair.a.generate([fresh])
    assert again["cached"] >= 0.95 * full_pages(fresh)
    assert again["output"] == cold_fresh["output"]
