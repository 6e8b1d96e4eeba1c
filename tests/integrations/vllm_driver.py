"""Run vLLM (the CPU build) on a tiny model in a process of its own and report what it did.

    python -m tests.integrations.vllm_driver PLAN.json OUT.json

PLAN: {"model": dir, "max_model_len": int, "max_tokens": int, "multiprocess": bool,
       "connector": {extra config} | null, "rounds": [[[token ids], ...], ...],
       "reset_prefix_cache": bool (before every round after the first),
       "between_rounds": [shell-free hook names] (see `_hook`),
       "tensor_parallel_size": int (default 1; > 1 runs one worker process per rank)}
OUT: {"rounds": [[{"output": [ids], "logprobs": [float], "cached": n}, ...], ...],
      "start_s": float, "round_s": [float]}

Each round is one `LLM.generate` call (greedy). `cached` is vLLM's `num_cached_tokens`:
after `reset_prefix_cache()` vLLM's own cache is empty, so a nonzero count is tokens the
connector loaded. One process per engine instance: two engines in one process share vLLM's
global state, and a second instance is what an L3 hit across engines needs anyway.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _env() -> None:
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }.items():
        os.environ.setdefault(key, value)


def _bind_ranks(tp_size: int) -> None:
    """vLLM's CPU workers bind their OpenMP threads to a NUMA node each unless told which
    CPUs: on a one-node machine, give each rank its slice of this process's CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cpus) // tp_size)
    slices = [cpus[(r * per_rank) % len(cpus) :][:per_rank] for r in range(tp_size)]
    os.environ.setdefault(
        "VLLM_CPU_OMP_THREADS_BIND", "|".join(",".join(map(str, s)) for s in slices)
    )


def run(plan: dict[str, Any]) -> dict[str, Any]:
    _env()
    if plan.get("tensor_parallel_size", 1) > 1:
        _bind_ranks(int(plan["tensor_parallel_size"]))
    if not plan.get("multiprocess", False):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if plan.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HicacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=plan["connector"],
            kv_load_failure_policy="recompute",
        )
    started = time.perf_counter()
    llm = LLM(
        model=plan["model"],
        dtype="bfloat16",
        max_model_len=plan.get("max_model_len", 2048),
        enforce_eager=True,
        seed=0,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        tensor_parallel_size=plan.get("tensor_parallel_size", 1),
        **kwargs,
    )
    start_s = time.perf_counter() - started
    params = SamplingParams(
        temperature=0.0, max_tokens=plan.get("max_tokens", 8), ignore_eos=True, logprobs=0
    )
    rounds = []
    timings = []
    for index, prompts in enumerate(plan["rounds"]):
        if index and plan.get("reset_prefix_cache", True):
            llm.reset_prefix_cache()
        hook = (plan.get("between_rounds") or {}).get(str(index))
        if hook:
            _hook(hook)
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        timings.append(time.perf_counter() - t0)
        rounds.append(
            [
                {
                    "output": list(o.outputs[0].token_ids),
                    # the chosen token's logprob per step: tokens alone miss a slightly wrong
                    # state (these random models' distributions are flat)
                    "logprobs": [
                        float(step[token].logprob)
                        for step, token in zip(
                            o.outputs[0].logprobs or [], o.outputs[0].token_ids, strict=True
                        )
                    ],
                    "cached": int(o.num_cached_tokens or 0),
                }
                for o in outputs
            ]
        )
    return {"rounds": rounds, "start_s": start_s, "round_s": timings}


def _hook(spec: dict[str, Any]) -> None:
    """Between rounds: wait for a file the test writes (it restarts or kills the sidecar
    meanwhile), after announcing that this round is about to start."""
    Path(spec["announce"]).write_text("ready")
    deadline = time.monotonic() + spec.get("timeout_s", 120)
    while not Path(spec["wait_for"]).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {spec['wait_for']} in time")
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    plan = json.loads(Path(argv[0]).read_text())
    result = run(plan)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
