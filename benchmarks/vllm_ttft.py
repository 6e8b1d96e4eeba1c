"""Time to first token of a long prompt in a real vLLM (the CPU build), with its prefix served
by hicache from L2 and from L3, by vLLM's own prefix cache (the local upper bound), and
recomputed — all in one run, on one machine state.

    .venv/bin/python benchmarks/vllm_ttft.py [--prefix 8192] [--suffix 256] [--reps 3]

The model is a ~95M-parameter random-weight Llama (8 layers, hidden 1024, 8 KV heads x 128,
`tests/integrations/vllm_models.py`, large=True): prefill dominates, and its KV is 32 KiB per
token, so an 8k prefix is 256 MiB of pages. Each request is a cached prefix plus `--suffix`
new tokens (so layer-wise loading can hide behind the suffix's compute), and separately a
full-prefix hit (only the last token computed: nothing to hide behind, the copy cost shows).
TTFT is the wall time of `generate(max_tokens=1)`; every figure is the median of `--reps`
requests, each with a suffix of its own and vLLM's prefix cache reset before it (except
where vLLM's own cache is what is measured).

Four engines, each in a process of its own, one after the other, against one `hicache serve`:
- plain (no connector): recompute; vLLM's own prefix hit (prefix + suffix, and full prefix);
- layerwise connector: hicache L2 hits (the forward waits per layer), each followed at once
  by the same prefix served from vLLM's own cache (the local figure every ratio uses: on a
  shared machine, engines run minutes apart see different loads), then L3 hits (L2 cleared
  through the admin API before each request);
- whole connector: L2 hits loaded completely before the forward starts (load-then-compute,
  the baseline of the layer-wise figure, on the same thread);
- async connector: L2 hits loaded between steps (what multi-group models use).

Then two engines at once (`cross_a`, `cross_b`, both running until both are done): A serves
`--cross-prompts` prompts of its own, B then serves the same prompts.
`two_engines_cross_hit_rate` is B's hit tokens over what A stored (whole pages of all but
the last token of each prompt); it needs a sidecar that lets two engines share a namespace.

Last line JSON: `ttft_l2_vs_recompute` (speed-up, target >= 8), `ttft_l2_vs_local_prefix_hit`
(target <= 1.15), `ttft_full_hit_vs_local` (the full-prefix hit over vLLM's own, <= 1.5; both
the median over requests of each hicache hit over vLLM's own hit timed right after it, and
`..._ratio_of_medians` beside them),
`store_on_step_s` (what the steps of a cold request of the prefix and suffix, and the next
step, waited for its stores: the layer-wise worker's counter) and `store_on_step_fraction`
(over that request's TTFT, <= 0.10), `ttft_l3_vs_recompute`, `layerwise_gain`
(load-then-compute TTFT over layer-wise TTFT), `async_vs_layerwise`,
`two_engines_cross_hit_rate` (>= 0.95), and every median in ms, with the hit each request
got and the workers' counters (`# mode:` lines). A ratio to the local hit below 0.9 would
mean hicache beat vLLM's own cache: flagged as a measurement fault.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = 500


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def engine(plan: dict[str, Any]) -> dict[str, Any]:
    """One engine process: the requests of its mode, timed."""
    from tests.integrations.vllm_driver import _env

    _env()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(plan["kv_space_gib"])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if plan["mode"] != "plain":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HicacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={
                "config": plan["deploy"],
                "load_mode": "auto" if plan["mode"].startswith("cross_") else plan["mode"],
                "stats_path": plan["stats_path"],
            },
            kv_load_failure_policy="recompute",
        )
    llm = LLM(
        model=plan["model"],
        dtype="bfloat16",
        max_model_len=plan["max_model_len"],
        max_num_batched_tokens=plan["max_model_len"],
        enforce_eager=True,
        seed=0,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rng = random.Random(plan["seed"])
    prefix = plan["prefix_tokens"]

    def ttft(prompt: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - t0, int(out.num_cached_tokens or 0)

    def clear_l2() -> None:
        request = urllib.request.Request(plan["http"] + "/v1/admin/clear?tier=l2", method="POST")
        with urllib.request.urlopen(request, timeout=30) as reply:
            reply.read()

    suffix = plan["suffix"]
    out: dict[str, Any] = {}
    ttft(_tokens(rng, 64))  # warm-up: first-call overheads out of the figures
    if plan["mode"].startswith("cross_"):
        return _cross(plan, ttft)
    if plan["mode"] == "plain":
        out["recompute"] = []
        for _ in range(plan["recompute_reps"]):
            llm.reset_prefix_cache()
            out["recompute"].append(ttft(prefix + _tokens(rng, suffix)))
        ttft(prefix + _tokens(rng, suffix))  # vLLM's cache now holds the prefix
        out["local"] = [ttft(prefix + _tokens(rng, suffix)) for _ in range(plan["reps"])]
        out["local_full"] = [ttft(prefix + _tokens(rng, 1)) for _ in range(plan["reps"])]
        return out
    before = _counters(plan["stats_path"])
    # the prefix stored (or already in hicache); its stores drain in the next step
    stored_s, _ = ttft(prefix + _tokens(rng, suffix))
    ttft(_tokens(rng, 64))
    waited = _counters(plan["stats_path"])["store_on_step_s"] - before["store_on_step_s"]
    out["store_on_step"] = [waited, stored_s]
    for key, reset_l2 in (("l2", False), ("l2_full", False), ("l3", True)):
        out[key] = []
        local = out[f"local_{key}"] = []
        for _ in range(plan["reps"]):
            llm.reset_prefix_cache()
            if reset_l2:
                clear_l2()
            new = 1 if key == "l2_full" else suffix
            out[key].append(ttft(prefix + _tokens(rng, new)))
            if key != "l3":  # at once, same engine and machine state: vLLM's own hit
                local.append(ttft(prefix + _tokens(rng, new)))
        if plan["mode"] != "layerwise":
            break  # load-then-compute: only its L2 figure is needed
    out["worker_counters"] = json.loads(Path(plan["stats_path"]).read_text())
    return out


def _counters(path: str) -> dict[str, Any]:
    """The worker's counters now (zeros before its first write)."""
    try:
        counters: dict[str, Any] = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {"store_on_step_s": 0.0}
    return counters


def _wait_for(path: Path, timeout_s: float = 1800) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} in {timeout_s} s")
        time.sleep(0.05)


def _cross(plan: dict[str, Any], ttft: Any) -> dict[str, Any]:
    """One of two engines up at once: A serves the prompts, then B serves them again; each
    stays up until both are done."""
    sync = Path(plan["sync_dir"])
    me, other = ("a", "b") if plan["mode"] == "cross_a" else ("b", "a")
    (sync / f"{me}.up").write_text("up")
    _wait_for(sync / f"{other}.up")
    if me == "b":
        _wait_for(sync / "a.served")
    served = [ttft(prompt) for prompt in plan["cross_prompts"]]
    if me == "a":
        ttft(_tokens(random.Random(plan["seed"]), 64))  # a next step: A's stores drained
    (sync / f"{me}.served").write_text("done")
    _wait_for(sync / f"{other}.served")
    return {"served": served}


def _start_engine(plan: dict[str, Any], work: Path) -> subprocess.Popen[str]:
    path = work / f"{plan['mode']}.json"
    path.write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, __file__, "--engine", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _result(proc: subprocess.Popen[str], mode: str) -> dict[str, Any]:
    stdout, stderr = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"engine {mode} failed:\n{stderr[-4000:]}")
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return result


def _run_engine(plan: dict[str, Any], work: Path) -> dict[str, Any]:
    return _result(_start_engine(plan, work), plan["mode"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=8192, help="cached prefix tokens")
    parser.add_argument("--suffix", type=int, default=256, help="new tokens after it")
    parser.add_argument(
        "--cross-prompts", type=int, default=4, help="prompts engine B hits of engine A's"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--recompute-reps", type=int, default=2)
    parser.add_argument("--engine", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine is not None:
        print(json.dumps(engine(json.loads(args.engine.read_text()))))
        return 0

    from hicache.client.process import SidecarProcess
    from tests.integrations.vllm_harness import write_deployment
    from tests.integrations.vllm_models import build_model

    page = 128
    if args.prefix % page:
        raise SystemExit(f"--prefix {args.prefix}: a multiple of vLLM's block ({page}) please")
    max_model_len = -(-(args.prefix + args.suffix + 64) // page) * page
    models = ROOT / ".hicache" / "bench-models"
    model = build_model("llama", models, large=True)
    kv_bytes_per_token = 8 * 8 * 128 * 2 * 2
    host_bytes = 3 * (args.prefix + args.suffix * (2 * args.reps + 2)) * kv_bytes_per_token
    kv_space_gib = max(1, -(-(3 * max_model_len * kv_bytes_per_token) // 2**30))
    with tempfile.TemporaryDirectory(prefix="hicache-ttft-") as tmp:
        work = Path(tmp)
        deploy = write_deployment(work / "sidecar", model, "llama")
        text = deploy.read_text().replace("capacity_bytes: 256MiB", f"capacity_bytes: {host_bytes}")
        deploy.write_text(text.replace("capacity_bytes: 1GiB", f"capacity_bytes: {4 * host_bytes}"))
        rng = random.Random(0)
        base = {
            "model": str(model),
            "deploy": str(deploy),
            "prefix_tokens": _tokens(rng, args.prefix),
            "suffix": args.suffix,
            "reps": args.reps,
            "recompute_reps": args.recompute_reps,
            "max_model_len": max_model_len,
            "kv_space_gib": kv_space_gib,
        }
        results: dict[str, dict[str, Any]] = {}
        # admin_without_token: the L3 runs empty L2 through /v1/admin/clear (loopback, no token)
        env = {"HICACHE_SERVICE__ADMIN_WITHOUT_TOKEN": "true"}
        with SidecarProcess(deploy, env=env) as sidecar:
            base["http"] = sidecar.http
            for seed, mode in enumerate(("plain", "layerwise", "whole", "async"), start=1):
                stats = str(work / f"{mode}.counters.json")
                plan = {**base, "mode": mode, "seed": seed, "stats_path": stats}
                results[mode] = _run_engine(plan, work)
                print(f"# {mode}: {json.dumps(results[mode])}", flush=True)
            sync = work / "cross"
            sync.mkdir()
            cross_rng = random.Random(99)
            prompts = [
                _tokens(cross_rng, 2 * page + 1 + cross_rng.randrange(page))
                for _ in range(args.cross_prompts)
            ]
            procs = {}
            for seed, mode in enumerate(("cross_a", "cross_b"), start=10):
                stats = str(work / f"{mode}.counters.json")
                plan = {
                    **base,
                    "mode": mode,
                    "seed": seed,
                    "stats_path": stats,
                    "sync_dir": str(sync),
                    "cross_prompts": prompts,
                }
                procs[mode] = _start_engine(plan, work)
            for mode, proc in procs.items():
                results[mode] = _result(proc, mode)
                print(f"# {mode}: {json.dumps(results[mode])}", flush=True)
            cross_stored = sum((len(p) - 1) // page * page for p in prompts)
            cross_hit = sum(n for _, n in results["cross_b"]["served"])

    def median_ms(mode: str, key: str) -> float:
        return float(1000 * statistics.median(t for t, _ in results[mode][key]))

    def hits(mode: str, key: str) -> list[int]:
        return [n for _, n in results[mode][key]]

    def paired(key: str) -> float:
        """The median over requests of hicache's TTFT over vLLM's own hit timed right
        after it (same engine, seconds apart): the machine's load drifts over minutes."""
        runs = results["layerwise"]
        return statistics.median(
            h / lo for (h, _), (lo, _) in zip(runs[key], runs[f"local_{key}"], strict=True)
        )

    recompute = median_ms("plain", "recompute")
    # vLLM's own hit right after each hicache hit, in the connector's engine: the machine
    # is shared, and ratios across engines run minutes apart measure its load, not us
    local, local_full = median_ms("layerwise", "local_l2"), median_ms("layerwise", "local_l2_full")
    plain_local = median_ms("plain", "local")
    plain_local_full = median_ms("plain", "local_full")
    l2, l2_full, l3 = (median_ms("layerwise", k) for k in ("l2", "l2_full", "l3"))
    store_waited_s, stored_request_s = results["layerwise"]["store_on_step"]
    l2_whole = median_ms("whole", "l2")
    l2_async = median_ms("async", "l2")
    figures = {
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "ttft_ms": {
            "recompute": round(recompute, 1),
            "local_prefix_hit": round(local, 1),
            "local_prefix_hit_plain_engine": round(plain_local, 1),
            "local_full_prefix_hit_plain_engine": round(plain_local_full, 1),
            "hicache_l2": round(l2, 1),
            "hicache_l3": round(l3, 1),
            "hicache_l2_load_then_compute": round(l2_whole, 1),
            "hicache_l2_async": round(l2_async, 1),
            "local_full_prefix_hit": round(local_full, 1),
            "hicache_l2_full_prefix_hit": round(l2_full, 1),
        },
        "hit_tokens": {
            "recompute": hits("plain", "recompute"),
            "local": hits("plain", "local"),
            "local_in_connector_engine": hits("layerwise", "local_l2"),
            "l2": hits("layerwise", "l2"),
            "l3": hits("layerwise", "l3"),
            "l2_load_then_compute": hits("whole", "l2"),
            "l2_async": hits("async", "l2"),
        },
        "ttft_l2_vs_recompute": round(recompute / l2, 2),
        "ttft_full_hit_vs_local": round(paired("l2_full"), 2),
        "ttft_full_hit_vs_local_ratio_of_medians": round(l2_full / local_full, 2),
        "store_on_step_s": round(store_waited_s, 4),
        "store_on_step_fraction": round(store_waited_s / stored_request_s, 3),
        "two_engines_cross_hit_rate": round(cross_hit / cross_stored, 3),
        "ttft_l3_vs_recompute": round(recompute / l3, 2),
        "ttft_l2_vs_local_prefix_hit": round(paired("l2"), 2),
        "ttft_l2_vs_local_prefix_hit_ratio_of_medians": round(l2 / local, 2),
        "layerwise_gain": round(l2_whole / l2, 2),
        "async_vs_layerwise": round(l2_async / l2, 2),
        "data_plane": results["layerwise"]["worker_counters"]["data_plane"],
    }
    expected = args.prefix
    if any(n != expected for n in figures["hit_tokens"]["l2"] + figures["hit_tokens"]["l3"]):
        figures["fault"] = "a hicache request did not hit the whole prefix"
    if l2 / local < 0.9:
        figures["fault"] = "hicache beat vLLM's own prefix cache: a measurement fault"
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
