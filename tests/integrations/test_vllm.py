"""hicache as a KV connector of a real vLLM (the CPU build, 0.32): hits change nothing but the
work done.

Per model (dense Llama; Gemma 3 sliding + full; gpt-oss sliding + sinks, HMA; Qwen3-Next GDN +
full; LFM2 short conv + full), against a run of the same prompts with no connector:
- L2: one engine stores A, then (vLLM's own cache reset) hits A's pages for B and for A;
- L3: the sidecar restarts (L2 gone), a second engine instance hits B from the file L3;
- corruption: every L3 object is damaged on disk, a sidecar restart later the hit fails
  verification and vLLM recomputes;
and greedy tokens and their logprobs equal the reference every time, with the hit counts vLLM
reports asserted (`num_cached_tokens`; vLLM's own cache is reset, so they are hicache's), and
which data plane moved the pages (the sidecar straight into vLLM's blocks, or staging).

Then faults and modes: the sidecar killed while an engine serves (no hits, same outputs, hits
again once a sidecar is back), vLLM's default multi-process mode, and a detector: a second
model with other weights served the first model's pages under one shared model name gives
other outputs, so the comparisons above can fail. Then two engines of one model in processes
of their own, attached to one sidecar at once: each hits what only the other has seen (both
orders of start), one is killed in the middle of a load while the other keeps hitting, and
outputs equal an engine's with the connector configured and nothing to load. A load that fails
after Llama's layer-wise forward ran over it stores nothing of that forward: what the engine
left in L3 equals, byte for byte, what an engine that never failed stores.

Engines are long-lived where a test needs no fresh one (`EngineProcess`): the references are
served by one plain engine per model kept for the module, the two-engine tests share theirs.
Every engine is still a process of its own, forked from a launcher that imported vLLM once
(`vllm_zygote.py`).

vLLM is required here (dev.py installs it; `dev.py test` sets _HICACHE_REQUIRE_VLLM); without it,
outside CI, the module skips.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hicache.client import Client, ClientError, connect, connect_deployment
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from hicache.index import KEY_BYTES
from tests.integrations.vllm_harness import (
    SSM_DTYPE,
    EngineProcess,
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


class References:
    """Outputs of vLLM with no connector, from long-lived engines shared by the module's
    tests (each round a `generate` after vLLM's own cache is reset, as `run_engine` runs
    them, so a round's outputs do not depend on what the engine served before). Engines of
    the kinds several tests compare against stay up; the others go after their round."""

    KEEP = ("llama", "qwen3_next")

    def __init__(self, work: Path, models: Path):
        self.work, self.models = work, models
        self.engines: dict[str, EngineProcess] = {}

    def __call__(
        self, kind: str, rounds: list[list[list[int]]], max_tokens: int = 8
    ) -> list[list[tuple[list[int], list[float]]]]:
        engine = self.engines.get(kind)
        if engine is None:
            engine = EngineProcess(self.work, _model(self.models, kind), name=f"ref-{kind}")
            self.engines[kind] = engine
        got = [engine.round(prompts, max_tokens) for prompts in rounds]
        if kind not in self.KEEP:
            self.engines.pop(kind).close()
        return outputs({"rounds": got})

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, models: Path) -> Iterator[References]:
    refs = References(tmp_path_factory.mktemp("vllm_references"), models)
    try:
        yield refs
    finally:
        refs.close()


def _model(models: Path, kind: str) -> Path:
    return build_model(kind, models)


# how each model's pages move (see the connector's `_direct`): the sidecar copies straight
# into vLLM's blocks, or through staging where a hicache group spans several vLLM groups
DATA_PLANE = {
    "llama": "direct",
    "gemma3": "staging",
    "gpt_oss": "direct",
    "qwen3_next": "staging",
    "lfm2": "direct",
}


def _connector(deploy: Path) -> dict[str, str]:
    return {"config": str(deploy)}


@pytest.mark.parametrize("kind", KINDS)
def test_hits_from_l2_and_l3_equal_recompute(
    kind: str, models: Path, tmp_path: Path, references: References
) -> None:
    model = _model(models, kind)
    p = Prompts.of(kind)
    rounds = [[p.a], [p.b], [p.a]]
    reference = references(kind, rounds)
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
    kind: str, models: Path, tmp_path: Path, references: References
) -> None:
    """SIGKILL the sidecar while the engine runs a round (B hitting A's pages, C new): every
    output still equals the reference; with no sidecar there are no hits; once one is back,
    the engine reconnects and hits again.

    Every step waits for an event, none for time. The kill comes once the sidecar has
    served B's load (its stats say so), so the rest of round 1 runs without it; before, a
    50 ms sleep decided whether the kill landed before, in or after round 1, and the whole
    engine run (a sidecar start included) had to fit fixed 120 / 400 s deadlines, which a
    busy machine overran. L3 is cleared with the restart, so round 3 stores C afresh
    whatever round 1 managed to persist; the deadlines left only bound a hung run."""
    model = _model(models, kind)
    p = Prompts.of(kind)
    rounds = [[p.a], [p.b, p.c], [p.b], [p.c], [p.c]]
    reference = references(kind, rounds, max_tokens=24)
    deploy = write_deployment(tmp_path / "sidecar", model, kind)
    l3 = tmp_path / "sidecar" / "l3"
    connector = _connector(deploy) | {"retry_after_s": 0.2, "load_timeout_s": 3}
    sidecar = SidecarProcess(deploy).start()
    engine = EngineProcess(tmp_path, model, connector=connector, name="engine")
    try:
        got = [engine.round([p.a], 24)]
        loads_before = served_loads(sidecar.get_json("/v1/stats"))
        engine.send_round([p.b, p.c], 24)  # round 1: B hits A's pages while the sidecar dies
        _until(
            lambda: served_loads(sidecar.get_json("/v1/stats")) > loads_before,
            "the sidecar served B's load",
        )
        sidecar.stop(signal.SIGKILL)
        got.append(engine.results())
        got.append(engine.round([p.b], 24))  # round 2: no sidecar at all
        shutil.rmtree(l3, ignore_errors=True)  # what round 1 left in L3 is not round 3's
        sidecar = SidecarProcess(deploy).start()
        got.append(engine.round([p.c], 24))  # round 3: C again, stored into the new sidecar
        got.append(engine.round([p.c], 24))  # round 4: C hits
    finally:
        engine.close()
        sidecar.stop()
    out = {"rounds": got}
    assert outputs(out) == reference
    hits = cached(out)
    assert hits[0] == [0]
    assert hits[2] == [0]  # round 2: the sidecar is gone
    assert hits[3] == [0]  # round 3: a new sidecar, L3 cleared: C computed and stored
    assert hits[4] == [p.hit(p.c)]  # reconnected, C stored in round 3, hit in round 4


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 600) -> None:
    """Wait for an event another process causes; the deadline only bounds a hung run."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.02)


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
def test_default_multiprocess_mode(
    kind: str, models: Path, tmp_path: Path, references: References
) -> None:
    """vLLM's default: the scheduler half in EngineCore, the worker half in a Worker
    process, both talking to one sidecar."""
    model = _model(models, kind)
    p = Prompts.of(kind)
    rounds = [[p.a], [p.b]]
    reference = references(kind, rounds)
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


def test_a_failed_load_never_stores_what_was_computed_over_it(
    models: Path, tmp_path: Path, references: References
) -> None:
    """Llama loads layer-wise: when its load fails, vLLM's forward has already run over the
    blocks the load never filled, and only then recomputes. The pages that step computed
    must not be stored: a later engine hitting them would be served KV of garbage.

    The judge is the stored bytes: every object the failed engine left in L3 equals, byte
    for byte, the object an engine that never saw a failure stores under the same key. (The
    outputs of a later hit are no judge here: on some CPUs a 640-token hit and a 70-token
    tail round differently from one 710-token prefill, stored bytes identical.)"""
    kind = "llama"
    model = _model(models, kind)
    p = Prompts.of(kind)
    rng = random.Random(3)
    longer = p.a + [rng.randrange(3, 500) for _ in range(2 * p.page + 20)]
    reference = references(kind, [[longer]])
    deploy = write_deployment(tmp_path / "sidecar", model, kind)
    with SidecarProcess(deploy):
        run_engine(tmp_path, model, [[p.a]], connector=_connector(deploy), name="store-a")
    assert corrupt_l3(tmp_path / "sidecar" / "l3") > 0  # A's pages: the load of `longer` fails
    connector = {**_connector(deploy), "stats_path": str(tmp_path / "bad.json")}
    with SidecarProcess(deploy) as sidecar:
        failed = run_engine(tmp_path, model, [[longer]], connector=connector, name="bad")
        assert sidecar.get_json("/v1/stats")["l3"]["corrupt_dropped"] > 0
    assert outputs(failed) == reference
    worker = json.loads((tmp_path / "bad.json").read_text())
    assert worker["load_failures"] == 1, worker
    assert worker["stores_skipped_failed_load"] == 1, worker
    clean = write_deployment(tmp_path / "clean", model, kind)
    with SidecarProcess(clean):
        run_engine(tmp_path, model, [[longer]], connector=_connector(clean), name="clean")
    stored, expected = _objects(tmp_path / "sidecar" / "l3"), _objects(tmp_path / "clean" / "l3")
    assert len(expected) == len(longer) // p.page  # every whole page of `longer`
    assert stored == expected


def test_a_load_served_short_keeps_its_leading_pages(
    models: Path, tmp_path: Path, references: References
) -> None:
    """Issue #32: page k of an L3 prefix damaged after the lookup counted it. The sidecar
    serves the k pages before it; vLLM is told only the blocks from k on, so it keeps those
    k pages and recomputes the rest (it recomputed from block 0 when the whole load was
    failed). Compared like with like: the outputs equal an engine's that was served exactly
    those k pages by a sidecar holding nothing more (the same split into hit and tail)."""
    kind, k = "llama", 2
    model = _model(models, kind)
    p = Prompts.of(kind)
    rng = random.Random(5)
    prompt = p.a + [rng.randrange(3, 500) for _ in range(2 * p.page + 20)]
    pages = len(prompt) // p.page
    deploy = write_deployment(tmp_path / "sidecar", model, kind)
    with SidecarProcess(deploy) as sidecar:
        run_engine(tmp_path, model, [[prompt]], connector=_connector(deploy), name="store")
        [namespace] = sidecar.get_json("/v1/stats")["namespaces"]
    tenant = namespace["namespace"].split("tenant=")[1].strip("'")  # vLLM's: its keys' root
    connector = {**_connector(deploy), "stats_path": str(tmp_path / "short.json")}
    with SidecarProcess(deploy) as sidecar:  # L2 empty: the prompt's pages are in L3 only
        client = connect_deployment(load_deployment(deploy), tenant=tenant, heartbeat=False)
        try:
            blob = client.page_keys(prompt).blobs["full"]
        finally:
            client.close()
        objects = [_l3_object(tmp_path / "sidecar" / "l3", blob, i) for i in range(pages)]
        assert all(path.is_file() for path in objects), objects  # every page of the prompt
        data = bytearray(objects[k].read_bytes())
        data[-1] ^= 0xFF  # page k's payload fails its checksum when the load reads it
        objects[k].write_bytes(bytes(data))
        short = run_engine(tmp_path, model, [[prompt]], connector=connector, name="short")
        assert sidecar.get_json("/v1/stats")["l3"]["corrupt_dropped"] == 1
    worker = json.loads((tmp_path / "short.json").read_text())
    assert (worker["loads"], worker["loads_partial"], worker["load_failures"]) == (1, 1, 0)
    assert worker["pages_loaded"] == k, worker

    clean = write_deployment(tmp_path / "clean", model, kind)
    with SidecarProcess(clean):  # a sidecar holding the k leading pages and nothing more
        run_engine(tmp_path, model, [[prompt[: k * p.page + 5]]], connector=_connector(clean))
    with SidecarProcess(clean):
        like = run_engine(tmp_path, model, [[prompt]], connector=_connector(clean), name="like")
    assert cached(like) == [[k * p.page]]
    assert outputs(short) == outputs(like)


def _l3_object(l3: Path, blob: bytes, page: int) -> Path:
    """The file of a file L3's object for the page key at `page` of a group's key blob."""
    name = blob[page * KEY_BYTES : (page + 1) * KEY_BYTES].hex()
    return l3 / name[:2] / f"{name}.kv"


def _objects(l3: Path) -> dict[str, str]:
    """A file L3's objects: key (the path under the store's folder) to the SHA-256 of its
    bytes, header and payload."""
    return {
        str(path.relative_to(l3)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(l3.rglob("*.kv"))
    }


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


# ---- two engines, one sidecar, at the same time --------------------------------------------


class Pair:
    """Engines of one model in processes of their own, attached to one sidecar at once (one
    namespace: the same tenant), and the like-for-like reference: an engine with the
    connector configured under a tenant of its own, so it never has anything to load (a
    connector changes vLLM's batching: compare with a connector run, not a plain one)."""

    def __init__(self, work: Path, model: Path):
        self.work, self.model = work, model
        self.deploy = write_deployment(work / "sidecar", model, "llama")
        self.sidecar = SidecarProcess(self.deploy).start()
        self.engines: dict[str, EngineProcess] = {}
        self.reference = self.start("reference", tenant="nothing-to-load-here")
        self.rng = random.Random(11)
        self.page = Prompts.of("llama").page
        self._expected: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def start(self, name: str, **extra: object) -> EngineProcess:
        connector = _connector(self.deploy) | {"stats_path": str(self.work / f"{name}.json")}
        engine = EngineProcess(self.work, self.model, connector=connector | extra, name=name)
        self.engines[name] = engine
        return engine

    def prompt(self) -> list[int]:
        """A prompt no engine has seen: three pages and a tail."""
        return [self.rng.randrange(3, 500) for _ in range(3 * self.page + 17)]

    def hit(self, prompt: list[int]) -> int:
        return (len(prompt) - 1) // self.page * self.page

    def expected(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        """The reference's output (each prompt served there once: a second time it would
        hit what the reference stored itself)."""
        key = tuple(prompt)
        if key not in self._expected:
            [result] = self.reference.round([prompt])
            assert result["cached"] == 0, "the reference engine had something to load"
            self._expected[key] = (result["output"], result["logprobs"])
        return self._expected[key]

    def namespace(self) -> dict[str, object]:
        """The engines' namespace in the sidecar's stats (not the reference's)."""
        stats = self.sidecar.get_json("/v1/stats")
        [ns] = [n for n in stats["namespaces"] if "nothing-to-load-here" not in n["namespace"]]
        return ns  # type: ignore[no-any-return]

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.sidecar.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, models: Path) -> Iterator[Pair]:
    shared = Pair(tmp_path_factory.mktemp("vllm_pair"), _model(models, "llama"))
    try:
        yield shared
    finally:
        shared.close()


def _served(engine: EngineProcess, prompt: list[int]) -> tuple[tuple[list[int], list[float]], int]:
    [result] = engine.round([prompt])
    return (result["output"], result["logprobs"]), result["cached"]


def test_two_engines_at_once_each_hit_what_only_the_other_has_seen(pair: Pair) -> None:
    """A starts first, then B, both stay up: each is served the other's prompts from L2,
    with the tokens and logprobs of the reference (the connector, nothing to load)."""
    a = pair.start("a").ready()
    b = pair.start("b").ready()
    only_a, only_b = pair.prompt(), pair.prompt()
    loads = int(pair.namespace()["load"]["ops"])  # type: ignore[index]
    assert _served(a, only_a) == (pair.expected(only_a), 0)
    assert _served(b, only_b) == (pair.expected(only_b), 0)
    assert _served(b, only_a) == (pair.expected(only_a), pair.hit(only_a))
    assert _served(a, only_b) == (pair.expected(only_b), pair.hit(only_b))
    ns = pair.namespace()
    assert int(ns["load"]["ops"]) - loads == 2, ns["load"]  # type: ignore[index]
    assert len(ns["attached_sessions"]) == 2, ns  # type: ignore[arg-type]  # both, at once


def test_an_engine_killed_mid_load_the_other_keeps_hitting(pair: Pair, tmp_path: Path) -> None:
    """A is SIGKILLed inside a load (it announces it from its first layer-wise wait and
    never returns); B, attached throughout, keeps hitting — A's prompts too. Then A2 starts
    after B (the other order of start) and each hits what only the other has seen."""
    a = pair.engines.get("a") or pair.start("a")
    b = pair.engines.get("b") or pair.start("b")
    a.ready()
    b.ready()
    by_a, by_b = pair.prompt(), pair.prompt()
    assert _served(a, by_a)[1] == 0
    assert _served(b, by_b)[1] == 0
    in_load = tmp_path / "a.in-load"
    a.pause_in_loads(in_load)
    a.send_round([by_b])  # a hit: A stops inside its load
    _until(in_load.exists, "engine A entered its load")
    assert _served(b, by_a) == (pair.expected(by_a), pair.hit(by_a))  # while A is stuck
    a.kill()
    del pair.engines["a"]
    _until(lambda: len(pair.namespace()["attached_sessions"]) == 1, "A's session ended")  # type: ignore[arg-type]
    assert _served(b, by_a) == (pair.expected(by_a), pair.hit(by_a))  # and after it died
    # the other order: B was there first, A2 joins
    a2 = pair.start("a2").ready()
    by_b2 = pair.prompt()
    assert _served(b, by_b2)[1] == 0
    assert _served(a2, by_b2) == (pair.expected(by_b2), pair.hit(by_b2))
    by_a2 = pair.prompt()
    assert _served(a2, by_a2)[1] == 0
    assert _served(b, by_a2) == (pair.expected(by_a2), pair.hit(by_a2))
    assert len(pair.namespace()["attached_sessions"]) == 2  # type: ignore[arg-type]  # B, A2
    status, _ = pair.sidecar.get("/readyz")
    assert status == 200
    counters = json.loads((pair.work / "b.json").read_text())
    assert counters["load_failures"] == 0, counters
