"""One `sglang.Engine` on a CPU in a process of its own, driven over stdin (runs in the SGLang
environment; `engine_harness.SglangEngine` starts it).

    python -m tests.integrations.sglang.engine_driver PLAN.json

PLAN: {"model": dir, "engine_args": {sglang.Engine keyword arguments over DEFAULTS}}
Lifecycle: starting (imports, engine up: 12-46 s on 2 shared cores) -> ready (one line
`{"ready": start_s}` on stdout) -> serving (one JSON command a line on stdin, one JSON reply a
line on stdout) -> stopped (EOF on stdin: engine shut down, process exits 0). Commands:
    {"generate": [[ids], ...], "max_new_tokens": n}
        -> {"results": [{"output": [ids], "cached": n, "prompt_tokens": n}, ...]}
        greedy, one request per prompt, in order; `cached` is SGLang's `cached_tokens`
    {"flush_cache": true} -> {"flushed": bool}   SGLang's device (and host) cache emptied
A failed command answers {"error": "..."} and the engine serves on. SGLang's logs go to
stderr; stdout carries only the replies.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

DEFAULTS: dict[str, Any] = {
    "device": "cpu",
    "dtype": "bfloat16",
    # on CPU SGLang checks that the memory available after loading the weights is at least
    # (1 - this) of what it was before: at 0.05 any other process allocating meanwhile (the
    # other engine starting beside it) failed the start; the KV pool is capped by
    # max_total_tokens either way, so a higher fraction allocates nothing more
    "mem_fraction_static": 0.5,
    "max_total_tokens": 4096,
    "page_size": 16,
    "disable_cuda_graph": True,
    "skip_server_warmup": True,
    # transformers 5.19 loads Qwen2Tokenizer for a tiny model's WordLevel tokenizer and
    # tokenizes every prompt to []: the tests send token ids
    "skip_tokenizer_init": True,
    "random_seed": 0,
    "log_level": "warning",
}


def _generate(engine: Any, prompts: list[list[int]], max_new_tokens: int) -> list[dict[str, Any]]:
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    results = []
    for prompt in prompts:
        out = engine.generate(input_ids=prompt, sampling_params=params)
        meta = out["meta_info"]
        results.append(
            {
                "output": list(out["output_ids"]),
                "cached": int(meta.get("cached_tokens") or 0),
                "prompt_tokens": int(meta.get("prompt_tokens") or len(prompt)),
            }
        )
    return results


def _command(engine: Any, command: dict[str, Any]) -> dict[str, Any]:
    if "generate" in command:
        return {"results": _generate(engine, command["generate"], command["max_new_tokens"])}
    if command.get("flush_cache"):
        flushed = engine.flush_cache()
        return {"flushed": bool(getattr(flushed, "success", flushed))}
    return {"error": f"unknown command {sorted(command)}; known: generate, flush_cache"}


def serve(plan: dict[str, Any]) -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever SGLang prints goes to stderr
    import sglang

    started = time.perf_counter()
    engine = sglang.Engine(model_path=plan["model"], **{**DEFAULTS, **plan.get("engine_args", {})})
    out.write(json.dumps({"ready": time.perf_counter() - started}) + "\n")
    for line in sys.stdin:
        try:
            reply = _command(engine, json.loads(line))
        except Exception as exc:  # the test reads it; the engine serves on
            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
    engine.shutdown()
    out.close()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str]) -> int:
    serve(json.loads(Path(argv[0]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
