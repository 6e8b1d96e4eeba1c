"""Run vLLM (the CPU build) on a tiny model in a process of its own and report what it did.

    python -m tests.integrations.vllm_driver PLAN.json OUT.json
    python -m tests.integrations.vllm_driver --serve PLAN.json    # long-lived, see `serve`

PLAN: {"model": dir, "max_model_len": int, "max_tokens": int, "multiprocess": bool,
       "connector": {extra config} | null, "rounds": [[[token ids], ...], ...],
       "reset_prefix_cache": bool (before every round after the first),
       "between_rounds": [shell-free hook names] (see `_hook`),
       "tensor_parallel_size": int (default 1; > 1 runs one worker process per rank),
       "kv_role": "kv_both" (default) | "kv_producer" | "kv_consumer"}
OUT: {"rounds": [[{"output": [ids], "logprobs": [float], "cached": n}, ...], ...],
      "start_s": float, "round_s": [float]}

Each round is one `LLM.generate` call (greedy). `cached` is vLLM's `num_cached_tokens`:
after `reset_prefix_cache()` vLLM's own cache is empty, so a nonzero count is tokens the
connector loaded. One process per engine instance: two engines in one process share vLLM's
global state, and a second instance is what an L3 hit across engines needs anyway. `--serve`
keeps one engine up for many rounds, driven over stdin (`serve`): tests share it where they
need no fresh engine, and two of them run side by side against one sidecar.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# vLLM choices pinned per model type, so that every machine runs the layout the tests'
# deployments describe (`vllm_harness.PAGE`, `SSM_DTYPE`). vLLM's CPU build picks Qwen3-Next's
# recurrent-state dtype by CPU: float32 where the CPU has AVX-512 BF16 (its accelerated GDN
# backend resets it), the model's bfloat16 elsewhere — and with it a 256-token block, not
# 384 — so on an AVX2-only machine the sidecar refused the engine at hello
VLLM_ARGS: dict[str, dict[str, Any]] = {"qwen3_next": {"mamba_ssm_cache_dtype": "float32"}}


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


def _llm(plan: dict[str, Any]) -> Any:
    """The engine a plan describes (in this process; started once)."""
    _env()
    if plan.get("tensor_parallel_size", 1) > 1:
        _bind_ranks(int(plan["tensor_parallel_size"]))
    if not plan.get("multiprocess", False):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if plan.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HicacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_role=plan.get("kv_role", "kv_both"),
            kv_connector_extra_config=plan["connector"],
            kv_load_failure_policy="recompute",
        )
    if plan.get("kv_events") is not None:  # vLLM's own KV-event publisher (ZMQ)
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", **plan["kv_events"]
        )
    model_type = json.loads((Path(plan["model"]) / "config.json").read_text())["model_type"]
    kwargs.update(VLLM_ARGS.get(model_type, {}))
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
    llm.start_s = time.perf_counter() - started
    return llm


def _round(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    """One `generate` call (greedy): per prompt its tokens, their logprobs and vLLM's
    `num_cached_tokens`."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
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


def run(plan: dict[str, Any], llm: Any) -> dict[str, Any]:
    rounds = []
    timings = []
    for index, prompts in enumerate(plan["rounds"]):
        if index and plan.get("reset_prefix_cache", True):
            llm.reset_prefix_cache()
        hook = (plan.get("between_rounds") or {}).get(str(index))
        if hook:
            _hook(hook)
        t0 = time.perf_counter()
        rounds.append(_round(llm, prompts, plan.get("max_tokens", 8)))
        timings.append(time.perf_counter() - t0)
    return {"rounds": rounds, "start_s": llm.start_s, "round_s": timings}


def _pause_in_loads(announce: Path) -> None:
    """From now on, the first layer-wise wait of a load announces itself and never returns:
    the engine is provably in the middle of a load when the test kills it."""
    from hicache.integrations.vllm.loads import Loads

    def wait_layer(self: Loads, layer_id: int) -> None:
        if self._pending:
            announce.write_text("in a load")
            while True:
                time.sleep(3600)

    Loads.wait_layer = wait_layer  # type: ignore[method-assign]


def serve(plan: dict[str, Any]) -> None:
    """A long-lived engine driven over stdin, one JSON command a line, one JSON reply a line
    on stdout (after a `{"ready": start_s}` line once the engine is up):
        {"prompts": [[ids], ...], "max_tokens": n}    one round (vLLM's own prefix cache
                                                       reset first), its results
        {"pause_in_loads": path}                       see `_pause_in_loads`
    EOF on stdin ends it. vLLM logs go to stderr; stdout carries only the replies."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything vLLM prints goes to stderr
    llm = _llm(plan)
    out.write(json.dumps({"ready": llm.start_s}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        if "pause_in_loads" in command:
            _pause_in_loads(Path(command["pause_in_loads"]))
            out.write(json.dumps({"ok": True}) + "\n")
            continue
        llm.reset_prefix_cache()
        out.write(json.dumps({"results": _round(llm, command["prompts"], command["max_tokens"])}))
        out.write("\n")
    out.close()
    _exit_after_shutdown(llm)


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
    if argv[0] == "--serve":
        serve(json.loads(Path(argv[1]).read_text()))
        return 0
    plan = json.loads(Path(argv[0]).read_text())
    llm = _llm(plan)
    result = run(plan, llm)
    Path(argv[1]).write_text(json.dumps(result))
    _exit_after_shutdown(llm)
    return 0


def _exit_after_shutdown(llm: Any) -> None:
    """vLLM's own shutdown (the connector's scheduler and worker sides included: a worker's
    stores end there), then exit without the interpreter's teardown: after the engine core's
    shutdown, its `gc.collect` and the interpreter freeing a model and a KV cache took 3.3 s
    of every engine process on an idle 2-vCPU machine, and nothing the tests read is left."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)  # in-process: the EngineCore itself
    if core is not None and hasattr(core, "model_executor") and hasattr(core, "scheduler"):
        core.model_executor.shutdown()
        core.scheduler.shutdown()
    else:  # the engine core in a process of its own: stopped and joined
        client.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
