"""Time to first token of a long prompt in a real vLLM (the CPU build), with its prefix served
by hicache from L2 and from L3, by vLLM's own prefix cache (the local upper bound), and
recomputed — all in one run, on one machine state.

    .venv/bin/python benchmarks/vllm_ttft.py [--prefix 8192] [--suffix 512] [--reps 3]

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
- layerwise connector: hicache L2 hits (the forward waits per layer), then L3 hits (L2
  cleared through the admin API before each request);
- whole connector: L2 hits loaded completely before the forward starts (load-then-compute,
  the baseline of the layer-wise figure, on the same thread);
- async connector: L2 hits loaded between steps (what multi-group models use).

Last line JSON: `ttft_l2_vs_recompute` (speed-up, target >= 5), `ttft_l2_vs_local_prefix_hit`
(target <= 1.3), `ttft_l3_vs_recompute`, `layerwise_gain` (load-then-compute TTFT over
layer-wise TTFT), `async_vs_layerwise`, the full-prefix figures, and every median in ms, with
the hit each request got and the workers' counters (`# mode:` lines). A ratio to the local hit
below 0.9 would mean hicache beat vLLM's own cache: flagged as a measurement fault.
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
                "load_mode": plan["mode"],
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
    out: dict[str, list[tuple[float, int]]] = {}
    ttft(_tokens(rng, 64))  # warm-up: first-call overheads out of the figures
    if plan["mode"] == "plain":
        out["recompute"] = []
        for _ in range(plan["recompute_reps"]):
            llm.reset_prefix_cache()
            out["recompute"].append(ttft(prefix + _tokens(rng, suffix)))
        ttft(prefix + _tokens(rng, suffix))  # vLLM's cache now holds the prefix
        out["local"] = [ttft(prefix + _tokens(rng, suffix)) for _ in range(plan["reps"])]
        out["local_full"] = [ttft(prefix + _tokens(rng, 1)) for _ in range(plan["reps"])]
        return out
    ttft(prefix + _tokens(rng, suffix))  # the prefix stored (or already in hicache)
    for key, reset_l2 in (("l2", False), ("l2_full", False), ("l3", True)):
        out[key] = []
        for _ in range(plan["reps"]):
            llm.reset_prefix_cache()
            if reset_l2:
                clear_l2()
            out[key].append(ttft(prefix + _tokens(rng, 1 if key == "l2_full" else suffix)))
        if plan["mode"] != "layerwise":
            break  # load-then-compute: only its L2 figure is needed
    out["worker_counters"] = json.loads(Path(plan["stats_path"]).read_text())
    return out


def _run_engine(plan: dict[str, Any], work: Path) -> dict[str, Any]:
    path = work / f"{plan['mode']}.json"
    path.write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, __file__, "--engine", str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise SystemExit(f"engine {plan['mode']} failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=8192, help="cached prefix tokens")
    parser.add_argument("--suffix", type=int, default=512, help="new tokens after it")
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

    def median_ms(mode: str, key: str) -> float:
        return float(1000 * statistics.median(t for t, _ in results[mode][key]))

    def hits(mode: str, key: str) -> list[int]:
        return [n for _, n in results[mode][key]]

    recompute = median_ms("plain", "recompute")
    local, local_full = median_ms("plain", "local"), median_ms("plain", "local_full")
    l2, l2_full, l3 = (median_ms("layerwise", k) for k in ("l2", "l2_full", "l3"))
    l2_whole = median_ms("whole", "l2")
    l2_async = median_ms("async", "l2")
    figures = {
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "ttft_ms": {
            "recompute": round(recompute, 1),
            "local_prefix_hit": round(local, 1),
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
            "l2": hits("layerwise", "l2"),
            "l3": hits("layerwise", "l3"),
            "l2_load_then_compute": hits("whole", "l2"),
            "l2_async": hits("async", "l2"),
        },
        "ttft_l2_vs_recompute": round(recompute / l2, 2),
        "ttft_l3_vs_recompute": round(recompute / l3, 2),
        "ttft_l2_vs_local_prefix_hit": round(l2 / local, 2),
        "layerwise_gain": round(l2_whole / l2, 2),
        "async_vs_layerwise": round(l2_async / l2, 2),
        "full_prefix_hit_l2_vs_local": round(l2_full / local_full, 2),
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
