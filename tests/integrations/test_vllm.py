"""hicache as a KV connector of a real vLLM (the CPU build, 0.32): hits change nothing but the
work done.

Per model (dense Llama; Gemma 3 sliding + full; gpt-oss sliding + sinks, HMA; Qwen3-Next GDN +
full; LFM2 short conv + full), against a run of the same prompts with no connector:
- L2: one engine stores A, then (vLLM's own cache reset) hits A's pages for B and for A;
- L3: the sidecar restarts (L2 gone), a second engine instance hits B from the file L3;
- corruption: every L3 object is damaged on disk, a sidecar restart later the hit fails
  verification and vLLM recomputes;
and greedy tokens and their logprobs equal the reference every time, with the hit counts vLLM
reports asserted (`num_cached_tokens`; vLLM's own cache is reset, so they are hicache's).

Then faults and modes: the sidecar killed while an engine serves (no hits, same outputs, hits
again once a sidecar is back), vLLM's default multi-process mode, and a detector: a second
model with other weights served the first model's pages under one shared model name gives
other outputs, so the comparisons above can fail.

vLLM is required here (dev.py installs it; `dev.py test` sets _HICACHE_REQUIRE_VLLM); without it,
outside CI, the module skips.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from hicache.client import Client, ClientError, connect
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from tests.integrations.vllm_harness import (
    SSM_DTYPE,
    Prompts,
    cached,
    corrupt_l3,
    outputs,
    run_engine,
    served_loads,
    write_deployment,
)
from tests.integrations.vllm_models import KINDS, build_model

if not os.environ.get("_HICACHE_REQUIRE_VLLM"):
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (python3 dev.py setup)")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm_models")


def _model(models: Path, kind: str) -> Path:
    return build_model(kind, models)


# how each model's pages move (see the connector's `_direct`): the sidecar copies straight
# into vLLM's blocks, or through staging where a hicache group spans several vLLM groups
DATA_PLANE = {
    "llama": "direct",
    "gemma3": "staging",
    "gpt_oss": "direct",
    "qwen3_next": "staging",
    "lfm2": "staging",
}


def _connector(deploy: Path) -> dict[str, str]:
    return {"config": str(deploy)}


@pytest.mark.parametrize("kind", KINDS)
def test_hits_from_l2_and_l3_equal_recompute(kind: str, models: Path, tmp_path: Path) -> None:
    model = _model(models, kind)
    p = Prompts.of(kind)
    rounds = [[p.a], [p.b], [p.a]]
    reference = outputs(run_engine(tmp_path, model, rounds, name="reference"))
    deploy = write_deployment(tmp_path / "sidecar", model, kind)

    # L2: one engine, its own prefix cache reset before every round
    stats_path = tmp_path / "worker.json"
    with SidecarProcess(deploy):
        connector = _connector(deploy) | {"stats_path": str(stats_path)}
        first = run_engine(tmp_path, model, rounds, connector=connector, name="l2")
    assert outputs(first) == reference
    assert cached(first) == [[0], [p.hit(p.b)], [p.hit(p.a)]]
    # the sidecar copied straight into vLLM's blocks where each hicache group's layers are in
    # one vLLM KV-cache group (one block id names a page); through staging elsewhere
    counters = json.loads(stats_path.read_text())
    assert counters["data_plane"] == DATA_PLANE[kind], counters
    assert counters["loads"] == 2, counters
    assert counters["load_failures"] == 0, counters
    if DATA_PLANE[kind] == "direct":
        assert counters["load_copy_s"] == 0, counters

    # L3: a restarted sidecar (L2 empty) and a second engine instance
    with SidecarProcess(deploy):
        second = run_engine(tmp_path, model, [[p.b]], connector=_connector(deploy), name="l3")
    assert outputs(second) == [reference[1]]
    assert cached(second) == [[p.hit(p.b)]]

    # every L3 object corrupted on disk: verification refuses them, vLLM recomputes. (vLLM's
    # num_cached_tokens keeps the hit it was promised when a load fails, so the sidecar's
    # counters say what was served: nothing.)
    assert corrupt_l3(tmp_path / "sidecar" / "l3") > 0
    with SidecarProcess(deploy) as sidecar:
        third = run_engine(tmp_path, model, [[p.a]], connector=_connector(deploy), name="bad")
        stats = sidecar.get_json("/v1/stats")
    assert outputs(third) == [reference[0]]
    assert stats["l3"]["corrupt_dropped"] > 0, stats["l3"]
    assert served_loads(stats) == 0, stats["namespaces"]


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_sidecar_killed_mid_run_engine_keeps_serving(
    kind: str, models: Path, tmp_path: Path
) -> None:
    """SIGKILL the sidecar while the engine runs a round: every output still equals the
    reference; with no sidecar there are no hits; once one is back, the engine reconnects
    and hits again."""
    model = _model(models, kind)
    p = Prompts.of(kind)
    rounds = [[p.a], [p.b, p.c], [p.b], [p.c], [p.c]]
    reference = outputs(run_engine(tmp_path, model, rounds, name="reference", max_tokens=24))
    deploy = write_deployment(tmp_path / "sidecar", model, kind)
    announce = {str(i): tmp_path / f"round{i}.started" for i in range(1, 5)}
    go = {str(i): tmp_path / f"round{i}.go" for i in range(1, 5)}
    hooks = {i: {"announce": str(announce[i]), "wait_for": str(go[i])} for i in announce}
    sidecar = SidecarProcess(deploy).start()
    result: dict[str, object] = {}

    def engine() -> None:
        try:
            result["out"] = run_engine(
                tmp_path,
                model,
                rounds,
                connector=_connector(deploy) | {"retry_after_s": 0.2, "load_timeout_s": 3},
                between_rounds=hooks,
                max_tokens=24,
                name="engine",
            )
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        _wait(announce["1"], thread)
        go["1"].write_text("go")  # round 1 runs (B hits A's pages) while the sidecar dies
        time.sleep(0.05)
        sidecar.stop(signal.SIGKILL)
        _wait(announce["2"], thread)
        go["2"].write_text("go")  # round 2: no sidecar at all
        _wait(announce["3"], thread)
        sidecar = SidecarProcess(deploy).start()
        go["3"].write_text("go")  # round 3: C again, stored into the new sidecar
        _wait(announce["4"], thread)
        go["4"].write_text("go")  # round 4: C hits
        thread.join(timeout=400)
    finally:
        sidecar.stop()
        for path in go.values():
            path.write_text("go")
        thread.join(timeout=60)
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    out = result["out"]
    assert outputs(out) == reference  # type: ignore[arg-type]
    hits = cached(out)  # type: ignore[arg-type]
    assert hits[0] == [0]
    assert hits[2] == [0]  # round 2: the sidecar is gone
    assert hits[4] == [p.hit(p.c)]  # reconnected, C stored in round 3, hit in round 4


def _wait(path: Path, thread: threading.Thread, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if not thread.is_alive() or time.monotonic() > deadline:
            raise AssertionError(f"the engine never reached {path.name}")
        time.sleep(0.05)


def _attach(socket: str, layer_map: object, tenant: str, kwargs: dict[str, object]) -> Client:
    """An engine session in `tenant`, once the exited vLLM's session has ended there."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return connect(socket, layer_map, tenant=tenant, **kwargs)  # type: ignore[arg-type]
        except ClientError as exc:
            if "is attached by" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_default_multiprocess_mode(kind: str, models: Path, tmp_path: Path) -> None:
    """vLLM's default: the scheduler half in EngineCore, the worker half in a Worker
    process, both talking to one sidecar."""
    model = _model(models, kind)
    p = Prompts.of(kind)
    rounds = [[p.a], [p.b]]
    reference = outputs(run_engine(tmp_path, model, rounds, name="reference"))
    deploy = write_deployment(tmp_path / "sidecar", model, kind)
    with SidecarProcess(deploy) as sidecar:
        out = run_engine(
            tmp_path, model, rounds, connector=_connector(deploy), multiprocess=True, name="mp"
        )
        # a hicache.client engine of the same model, in vLLM's tenant, sees vLLM's pages
        # (vLLM has exited: its worker's namespace is free to attach)
        [namespace] = sidecar.get_json("/v1/stats")["namespaces"]
        tenant = namespace["namespace"].split("tenant=")[1].strip("'")
        assert tenant.startswith("vllm-cpu-")
        layer_map = load_deployment(deploy).layer_map()
        kwargs: dict[str, object] = {"page_size_tokens": p.page, "heartbeat": False}
        if kind in SSM_DTYPE:
            kwargs["ssm_state_dtype"] = SSM_DTYPE[kind]
        for name, expected in ((tenant, p.hit(p.b)), ("another", 0)):
            with _attach(sidecar.socket, layer_map, name, kwargs) as client:
                client.register_pools(client.create_pools(4))
                assert client.lookup(p.b).tokens_total == expected, name
    assert outputs(out) == reference
    assert cached(out) == [[0], [p.hit(p.b)]]


@pytest.mark.parametrize("kind", ["llama", "qwen3_next"])
def test_detector_other_weights_under_one_name_change_outputs(
    kind: str, models: Path, tmp_path: Path
) -> None:
    """Two checkpoints with different weights, one `model.name`: the second engine is served
    the first's pages and its outputs differ from its own reference. Equal outputs above
    are therefore evidence the loaded bytes are right, not a comparison that cannot fail."""
    import torch
    from safetensors.torch import load_file, save_file

    model = _model(models, kind)
    other = tmp_path / "other"
    other.mkdir()
    for item in model.iterdir():
        if item.suffix != ".safetensors":
            (other / item.name).write_bytes(item.read_bytes())
    generator = torch.Generator().manual_seed(7)
    for item in model.glob("*.safetensors"):
        tensors = load_file(item)
        for name, value in tensors.items():
            if value.is_floating_point() and value.dim() >= 2:
                noise = torch.randn(value.shape, generator=generator) * 0.1
                tensors[name] = (value.float() + noise).to(value.dtype)
        save_file(tensors, other / item.name, metadata={"format": "pt"})
    p = Prompts.of(kind)
    own = outputs(run_engine(tmp_path, other, [[p.b]], name="other-reference"))
    deploy = write_deployment(tmp_path / "sidecar", model, kind, name="one-name-for-both")
    with SidecarProcess(deploy):
        run_engine(tmp_path, model, [[p.a]], connector=_connector(deploy), name="first")
        served = run_engine(tmp_path, other, [[p.b]], connector=_connector(deploy), name="second")
    assert cached(served) == [[p.hit(p.b)]]
    assert outputs(served) != own


def test_a_failed_load_never_stores_what_was_computed_over_it(models: Path, tmp_path: Path) -> None:
    """Llama loads layer-wise: when its load fails, vLLM's forward has already run over the
    blocks the load never filled, and only then recomputes. The pages that step computed
    must not be stored: a later engine hitting them would be served KV of garbage."""
    kind = "llama"
    model = _model(models, kind)
    p = Prompts.of(kind)
    rng = random.Random(3)
    longer = p.a + [rng.randrange(3, 500) for _ in range(2 * p.page + 20)]
    reference = outputs(run_engine(tmp_path, model, [[longer]], name="reference"))
    deploy = write_deployment(tmp_path / "sidecar", model, kind)
    with SidecarProcess(deploy):
        run_engine(tmp_path, model, [[p.a]], connector=_connector(deploy), name="store-a")
    assert corrupt_l3(tmp_path / "sidecar" / "l3") > 0  # A's pages: the load of `longer` fails
    with SidecarProcess(deploy) as sidecar:
        failed = run_engine(tmp_path, model, [[longer]], connector=_connector(deploy), name="bad")
        assert sidecar.get_json("/v1/stats")["l3"]["corrupt_dropped"] > 0
        again = run_engine(tmp_path, model, [[longer]], connector=_connector(deploy), name="hit")
    assert outputs(failed) == reference
    assert cached(again) == [[p.hit(longer)]]
    assert outputs(again) == reference


def test_tensor_parallel_ranks_each_load_their_own_heads(models: Path, tmp_path: Path) -> None:
    """vLLM at tensor_parallel_size 2 (two worker processes, one KV head each of the tiny
    Llama's two) against a sidecar serving model.tp_size 2: each worker attaches as its rank,
    stores and loads its own heads, and the outputs equal vLLM's own at the same size."""
    model = _model(models, "llama")
    p = Prompts.of("llama")
    rounds = [[p.a], [p.b], [p.a]]
    tp = {"multiprocess": True, "tensor_parallel_size": 2}
    reference = outputs(run_engine(tmp_path, model, rounds, name="reference-tp2", **tp))
    deploy = write_deployment(tmp_path / "sidecar", model, "llama", tp_size=2)
    connector = {**_connector(deploy), "stats_path": str(tmp_path / "worker.json")}
    with SidecarProcess(deploy) as sidecar:
        got = run_engine(tmp_path, model, rounds, connector=connector, name="tp2", **tp)
        namespaces = sidecar.get_json("/v1/stats")["namespaces"]
    assert outputs(got) == reference
    assert cached(got) == [[0], [p.hit(p.b)], [p.hit(p.a)]]
    by_rank = {ns["namespace"].split()[0]: ns for ns in namespaces}
    assert sorted(by_rank) == ["tp_rank=0", "tp_rank=1"]  # one namespace per worker
    for name, ns in by_rank.items():
        assert int(ns["load"]["ops"]) >= 2, (name, ns["load"])  # both hits, on both ranks
        assert ns["groups"]["full"]["l2_pages"] > 0, (name, ns["groups"])
    # each worker's own counters (one file per rank): every load it was given landed whole,
    # so neither rank's miss was hidden by vLLM recomputing it
    for rank in (0, 1):
        counters = json.loads((tmp_path / f"worker.rank{rank}.json").read_text())
        assert counters["loads"] >= 2, (rank, counters)
        assert counters["load_failures"] == 0, (rank, counters)
        assert counters["pages_loaded"] > 0, (rank, counters)
