"""Prefill/decode through the cache with real vLLM (the CPU build): a prefill instance
(`kv_role="kv_producer"`) and a decode instance (`kv_consumer`), each a process of its own,
on one sidecar (shared L2). The proxy (`disaggregated`, the one docs/engines.md
"Disaggregated prefill" shows, run as written with its HTTP call swapped for the engine
processes) sends each prompt to the prefill instance with
`max_tokens=1`, then to the decode instance.

Judges:
- the decode instance's greedy tokens and per-step logprobs equal a single instance's run of
  the same prompts with the connector configured and nothing to load (the decode instance
  itself, first, on an empty sidecar: it never stores, so nothing is there after it);
- its `num_cached_tokens` is every complete page of the prompt (vLLM's own cache is reset
  before each round: the tokens are hicache's), and it stored nothing (its decode steps
  fill a page, which a kv_both engine would store): L2 holds the prefill's pages only;
- the prefill's steps ended with their stores acknowledged in L2 (its stats file);
- a decode request sent while the prefill's store is still in flight (the sidecar's backup
  copies held by a file the test removes: `FakeCopyBackend`'s `backup_hold_path`) waits for
  it and hits instead of recomputing — without holding vLLM's scheduler thread: the
  sidecar answers each lookup at once saying a store is writing, the connector answers vLLM
  "ask again later", vLLM's scheduler steps on (its stats file written with the wait in
  progress) and asks again; the sidecar held no reply, the decode instance's scheduler half
  counts one wait that hit.

vLLM is required here as in test_vllm.py; without it, outside CI, the module skips.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hicache.client.process import SidecarProcess
from hicache.testing import serve as fault_serve
from tests.integrations.vllm_harness import PAGE, ROOT, EngineProcess, write_deployment
from tests.integrations.vllm_models import build_model

if not os.environ.get("_HICACHE_REQUIRE_VLLM"):
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (python3 dev.py setup)")

KIND = "llama"
P = PAGE[KIND]
DECODE_TOKENS = 8
# three full pages and a tail that the decode steps fill into a fourth page (a kv_both
# engine would store it; the decode instance must not)
PROMPT_LEN = 4 * P - DECODE_TOKENS // 2


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(PROMPT_LEN)]


SEQUENTIAL = [prompt(11), prompt(12)]
IN_FLIGHT = prompt(13)


@dataclass
class Pair:
    sidecar: SidecarProcess
    prefill: EngineProcess
    decode: EngineProcess
    hold: Path  # while this file exists, the sidecar's backup copies wait
    stats: Callable[[str], dict[str, Any]]  # an engine's stats file (worker or .scheduler)
    reference: dict[tuple[int, ...], dict[str, Any]]  # per prompt: the decode run alone


def docs_proxy() -> dict[str, Any]:
    """docs/engines.md's proxy (`pd_proxy.py`), its code as written, not run as a script."""
    text = (ROOT / "docs" / "engines.md").read_text()
    start = text.index("A proxy sends each prompt to the prefill instance")
    code = text[text.index("```python\n", start) + len("```python\n") :]
    namespace: dict[str, Any] = {"__name__": "pd_proxy"}
    exec(compile(code[: code.index("```")], "docs/engines.md (pd_proxy.py)", "exec"), namespace)
    return namespace


def disaggregated(
    prefill: EngineProcess, decode: EngineProcess, prompts: list[list[int]], max_tokens: int
) -> list[dict[str, Any]]:
    """Each prompt through the docs' proxy: its prefill (one token: its pages stored,
    acknowledged in L2 before the reply), then its decode (loading them). The proxy's
    `complete` (an HTTP call to a vLLM server there) is this test's engine processes."""
    proxy = docs_proxy()
    engines = {"prefill": prefill, "decode": decode}

    def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        [result] = engines[url].round([prompt], max_tokens=max_tokens)
        return result

    proxy["complete"] = complete
    return [proxy["disaggregated"]("prefill", "decode", KIND, p, max_tokens) for p in prompts]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    work = tmp_path_factory.mktemp("vllm_disagg")
    model = build_model(KIND, tmp_path_factory.mktemp("vllm_models"))
    deploy = write_deployment(work / "sidecar", model, KIND)
    hold = work / "hold-backups"
    sidecar = SidecarProcess(
        deploy, command=fault_serve.command({"backup_hold_path": str(hold)})
    ).start()
    engines: list[EngineProcess] = []
    try:
        for name, role, extra in (
            ("prefill", "kv_producer", {}),
            # the test's bound on the wait, far over a held store's few seconds
            ("decode", "kv_consumer", {"store_wait_s": 60}),
        ):
            connector = {
                "config": str(deploy),
                "stats_path": str(work / f"{name}.stats.json"),
                "load_timeout_s": 60,  # a held store's reply outlasts the default 10 s
                **extra,
            }
            engines.append(EngineProcess(work, model, connector=connector, name=name, kv_role=role))
        prefill, decode = (engine.ready() for engine in engines)

        def stats(name: str) -> dict[str, Any]:
            data: dict[str, Any] = json.loads((work / name).read_text())
            return data

        # the reference: the decode instance alone on an empty sidecar (nothing to load),
        # each prompt in a round of its own as the proxy sends it (a batch's composition
        # changes CPU kernels' rounding)
        prompts = [*SEQUENTIAL, IN_FLIGHT]
        alone = [decode.round([p], max_tokens=DECODE_TOKENS)[0] for p in prompts]
        assert [r["cached"] for r in alone] == [0] * len(prompts)
        assert l2_pages(sidecar) == 0  # the decode instance stored nothing
        reference = {tuple(p): r for p, r in zip(prompts, alone, strict=True)}
        yield Pair(sidecar, prefill, decode, hold, stats, reference)
    finally:
        hold.unlink(missing_ok=True)
        for engine in engines:
            engine.close()
        sidecar.stop()


def l2_pages(sidecar: SidecarProcess) -> int:
    namespaces = sidecar.get_json("/v1/stats")["namespaces"]
    return sum(g["l2_pages"] for ns in namespaces for g in ns["groups"].values())


def until(condition: Callable[[], bool], what: str, timeout_s: float = 300) -> None:
    """Poll `condition` (the sidecar's stats) until it holds; the deadline bounds a hang."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.02)


def full_pages(tokens: list[int]) -> int:
    return len(tokens) // P * P


def test_decode_after_prefill_equals_one_instance_and_loads_every_page(pair: Pair) -> None:
    results = disaggregated(pair.prefill, pair.decode, SEQUENTIAL, DECODE_TOKENS)
    for tokens, got in zip(SEQUENTIAL, results, strict=True):
        want = pair.reference[tuple(tokens)]
        assert (got["output"], got["logprobs"]) == (want["output"], want["logprobs"])
        assert got["cached"] == full_pages(tokens)
    # L2 holds exactly the prefills' pages: the decode steps' full fourth pages not stored
    assert l2_pages(pair.sidecar) == sum(full_pages(t) // P for t in SEQUENTIAL)
    prefill, decode = pair.stats("prefill.stats.json"), pair.stats("decode.stats.json")
    assert prefill["stores_in_l2"] == prefill["stores"] >= len(SEQUENTIAL), prefill
    assert (prefill["store_failures"], prefill["stores_truncated"]) == (0, 0), prefill
    assert prefill["pages_stored"] == sum(full_pages(t) // P for t in SEQUENTIAL)
    assert (decode["stores"], decode["pages_stored"]) == (0, 0), decode
    assert decode["loads"] == len(SEQUENTIAL), decode
    assert decode["load_failures"] == 0, decode


def test_decode_sent_while_the_prefills_store_is_in_flight_waits_and_hits(pair: Pair) -> None:
    pair.hold.touch()  # the sidecar's backup copies wait from now on
    pair.prefill.send_round([IN_FLIGHT], max_tokens=1)
    until(
        lambda: any(ns["stores_writing_pages"] for ns in stats_of(pair)["namespaces"]),
        "the prefill's store in flight",
    )
    pair.decode.send_round([IN_FLIGHT], max_tokens=DECODE_TOKENS)
    # vLLM asked again after "ask again later" (each ask answered at once), and its
    # scheduler stepped on meanwhile: build_connector_meta wrote the wait in progress
    until(
        lambda: stats_of(pair)["store_waits"]["answered_writing"] >= 2,
        "the decode's lookup asked again while the store was in flight",
    )
    until(
        lambda: scheduler_stats(pair).get("store_waits_waiting") == 1,
        "the decode's scheduler stepping on with the request waiting",
    )
    pair.hold.unlink()  # the store lands
    [got] = pair.decode.results()
    pair.prefill.results()
    want = pair.reference[tuple(IN_FLIGHT)]
    assert (got["output"], got["logprobs"]) == (want["output"], want["logprobs"])
    assert got["cached"] == full_pages(IN_FLIGHT)  # loaded, not recomputed
    waits = stats_of(pair)["store_waits"]
    assert (waits["waits"], waits["waiting"]) == (0, 0), waits  # the sidecar held no reply
    scheduler = pair.stats("decode.stats.scheduler.json")
    assert scheduler["kv_role"] == "kv_consumer"
    assert scheduler["store_waits"] == {"hit": 1}, scheduler
    assert scheduler["store_waits_waiting"] == 0, scheduler


def scheduler_stats(pair: Pair) -> dict[str, Any]:
    """The decode instance's scheduler half's stats file ({} before its first write)."""
    try:
        return pair.stats("decode.stats.scheduler.json")
    except FileNotFoundError:
        return {}


def stats_of(pair: Pair) -> dict[str, Any]:
    stats: dict[str, Any] = pair.sidecar.get_json("/v1/stats")
    return stats
