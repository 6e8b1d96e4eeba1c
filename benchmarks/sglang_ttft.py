"""Time to first token of a long prompt in real SGLang (0.5.23, CPU engine), its prefix served
by hicache through the linker (`HicacheLinker`), by SGLang's own HiCache from its host memory
(L2) and from its `file` L3, by hicache as SGLang's HiCache storage backend (when installed),
and recomputed — all in one run, on one machine state.

    SGLANG_TEST_PYTHON=.venv-sglang/bin/python .venv/bin/python benchmarks/sglang_ttft.py \
        [--prefix 8192] [--suffix 256] [--reps 3]

The SGLang processes run in the SGLang environment (`.venv-sglang`, or `$SGLANG_TEST_PYTHON`),
driven over stdin (`tests/integrations/sglang/engine_harness.py`); `hicache serve` runs from
this environment. The model is a random-weight Qwen2 built at start (`--layers` 2, `--hidden`
1024, `--heads` 8, `--kv-heads` 4 x 128 (SGLang's Qwen2 takes head_dim as hidden / heads),
`--intermediate` 20480, vocab 512: 4 KiB of KV a token, 32 MiB for an 8k prefix). Its MLP is
wide on purpose: SGLang's CPU attention (`torch_native`, the only one without AMX) computes
every request's attention over the whole sequence, cached prefix included (it pads the new
tokens' queries to the full length: `_run_sdpa_forward_extend`), so a hit still pays the
prompt's whole attention and only the per-token work (projections, MLP) is saved. The
default shape gives the per-token work per unit of attention of a 7B model at this length
(Qwen2-7B: 466 MFLOP a token a layer against 59 MFLOP of causal attention at 8k, 7.9x; this
model 132 against 17); the earlier narrow one (`--layers 4 --intermediate 2048`) did 1.1x,
which no cache on this engine could turn into a 5x TTFT. Each request is the cached prefix
plus `--suffix` new tokens (a suffix of its own each time), TTFT is the wall time of a
1-token greedy generation, every figure the median of `--reps` requests. Engines run one
after another, each against what it needs:

- plain (no hicache, no HiCache): the prefix recomputed (SGLang's cache flushed before each),
  then hit in SGLang's own device pool (not flushed): `bound_device_hit_vs_recompute`, the
  most any host tier can give on this engine (a larger `ttft_hicache_vs_recompute` means
  the measurement is wrong, and the run says so);
- linker (`--enable-unified-cache-external-linker`, hicache's sidecar): the prefix computed
  once (offloaded to the sidecar), then SGLang's cache flushed before each request: every
  prefix page comes from the sidecar, layer by layer;
- sglang_l2 (`--enable-hierarchical-cache`, no L3): two prefixes that do not fit SGLang's device
  pool together, alternated, so each request finds its prefix only in SGLang's host memory
  (write-through put it there; the other prefix evicted it from the device);
- sglang_file_l3 (HiCache + the `file` backend): the prefix computed once, then SGLang's cache
  (device and host) flushed before each request: the prefix is prefetched from the files;
- hicache_backend (HiCache + `dynamic` backend `--backend MODULE:CLASS`, the sidecar as L3):
  as sglang_file_l3; skipped, and its figure null, when MODULE:CLASS cannot be imported;
- two linked engines at once: A serves `--cross-prompts` prompts of its own, B the same ones;
  `two_engines_cross_hit_rate` is B's cached tokens over their whole pages.

Last line JSON: `ttft_linker_vs_sglang_l2` (target <= 1.2), `ttft_backend_vs_sglang_file_l3`
(<= 1.0), `ttft_hicache_vs_recompute` (recompute over the linker hit, >= 5) and its bound,
`two_engines_cross_hit_rate` (>= 0.95), every median in ms and the hits each request got.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hicache.client.process import SidecarProcess  # noqa: E402
from tests.integrations.sglang.engine_harness import SglangEngine, require_sglang  # noqa: E402
from tests.integrations.sglang.sglang_env import sglang_environ  # noqa: E402

PAGE = 16
VOCAB = 512
BUILD = """
import json, sys, torch
from transformers import AutoModelForCausalLM, Qwen2Config
out = sys.argv[1]
layers, hidden, intermediate, heads, kv_heads = (int(a) for a in sys.argv[2:7])
torch.manual_seed(0)
config = Qwen2Config(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate,
    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
    head_dim=hidden // heads, max_position_embeddings=32768, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16")
AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(out)
"""


def build_model(python: Path, out: Path, shape: list[int]) -> Path:
    """A random-weight Qwen2 of `shape` (layers, hidden, intermediate, heads, KV heads)."""
    if not (out / "config.json").exists():
        subprocess.run(
            [str(python), "-c", BUILD, str(out), *map(str, shape)],
            env=sglang_environ(cpu_shims=False),
            check=True,
            timeout=600,
        )
    return out


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def timed(engine: SglangEngine, prompt: list[int]) -> tuple[float, int]:
    """TTFT (s) of a 1-token greedy generation, and the tokens SGLang had cached."""
    started = time.perf_counter()
    [result] = engine.generate([prompt], max_new_tokens=1)
    return time.perf_counter() - started, int(result["cached"])


def flush(engine: SglangEngine, timeout_s: float = 120.0) -> None:
    """Empty SGLang's device and host cache. SGLang refuses while it is not idle (a backup to
    its L3 still in flight after the request that computed the prefix), answering False:
    asked again until it answers True, so that a "hit after a flush" is never a device hit."""
    deadline = time.monotonic() + timeout_s
    while not engine.flush_cache():
        if time.monotonic() > deadline:
            raise SystemExit(f"sglang_ttft: SGLang did not flush its cache in {timeout_s:g} s")
        time.sleep(0.05)


def median_ms(samples: list[tuple[float, int]]) -> float:
    return round(statistics.median(s for s, _ in samples) * 1e3, 1)


class Run:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.args = args
        self.work = work
        self.python = require_sglang_python()
        shape = [args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads]
        self.model = build_model(self.python, work / "model", shape)
        self.rng = random.Random(args.seed)
        self.prefix = tokens(self.rng, args.prefix)
        self.deploy = self.write_deploy()
        self.base = {
            "max_total_tokens": args.prefix + args.suffix + 64 * PAGE,
            "chunked_prefill_size": 4096,
            # the CPU engine checks its static share against the memory free at start: with
            # other processes busy, the harness's 0.05 can leave this model no KV (refused)
            "mem_fraction_static": 0.5,
            "context_length": args.prefix + args.suffix + 64,
        }

    def write_deploy(self) -> Path:
        text = "\n".join(
            [
                "model:",
                f"  config_path: {self.model / 'config.json'}",
                "  dtype: bfloat16",
                f"  page_size_tokens: {PAGE}",
                "device:",
                "  kind: cpu",
                "host:",
                "  capacity_bytes: 2GiB",
                "storage:",
                "  kind: none",
                "service:",
                f"  socket_path: {self.work / 'engine.sock'}",
                "  http_host: 127.0.0.1",
                "  http_port: 0",
            ]
        )
        path = self.work / "deploy.yaml"
        path.write_text(text + "\n")
        return path

    @staticmethod
    def show(name: str, samples: list[tuple[float, int]]) -> list[tuple[float, int]]:
        print(
            f"# {name}: " + ", ".join(f"{s * 1e3:.0f} ms (cached {c})" for s, c in samples),
            flush=True,
        )
        return samples

    def engine(self, name: str, extra: dict[str, Any] | None = None) -> SglangEngine:
        args = {**self.base, **(extra or {})}
        engine = SglangEngine(self.work, self.model, engine_args=args, name=name)
        engine.ready(timeout_s=1200)
        print(f"# {name}: up in {engine.start_s:.1f} s", flush=True)
        return engine

    def request(self, prefix: list[int]) -> list[int]:
        return prefix + tokens(self.rng, self.args.suffix)

    def linker_args(self) -> dict[str, Any]:
        return {
            "enable_unified_cache_external_linker": True,
            "unified_cache_external_linker_backend": "dynamic",
            "unified_cache_external_linker_config": {
                "linker": "HicacheLinker",
                "linker_module_path": "hicache.integrations.sglang.linker",
                "linker_extra_config": {"config": str(self.deploy), "load_timeout_s": 60},
            },
        }

    def hicache_args(
        self, backend: str | None, extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        args: dict[str, Any] = {
            "enable_hierarchical_cache": True,
            "hicache_io_backend": "direct",
            "hicache_mem_layout": "page_first_direct",
            "hicache_size": 1,
        }
        if backend is not None:
            args["hicache_storage_backend"] = backend
            args["hicache_storage_backend_extra_config"] = json.dumps(extra or {})
        return args

    # ---- the engines ------------------------------------------------------------------------

    def flushed_hits(self, name: str, extra: dict[str, Any]) -> list[tuple[float, int]]:
        """The prefix computed once, then each request after SGLang flushed its cache."""
        with self.engine(name, extra) as engine:
            engine.generate([self.prefix], max_new_tokens=1)
            samples = []
            for _ in range(self.args.reps):
                flush(engine)
                samples.append(timed(engine, self.request(self.prefix)))
            return self.show(name, samples)

    def recompute(self) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
        """The prefix recomputed (flushed before each request), then the same engine's own
        device-pool hits of it (not flushed): the second is the bound of every host tier."""
        with self.engine("plain") as engine:
            samples = []
            for _ in range(self.args.reps):
                flush(engine)
                samples.append(timed(engine, self.request(self.prefix)))
            hits = [timed(engine, self.request(self.prefix)) for _ in range(self.args.reps)]
            return self.show("recompute", samples), self.show("device_hit", hits)

    def sglang_l2(self) -> list[tuple[float, int]]:
        other = tokens(self.rng, self.args.prefix)
        with self.engine("sglang_l2", self.hicache_args(None)) as engine:
            engine.generate([self.prefix], max_new_tokens=1)
            engine.generate([other], max_new_tokens=1)  # evicts the prefix to host memory
            samples = []
            for i in range(self.args.reps):
                wanted, evicting = (self.prefix, other) if i % 2 == 0 else (other, self.prefix)
                samples.append(timed(engine, self.request(wanted)))
                engine.generate([evicting], max_new_tokens=1)
            return self.show("sglang_l2", samples)

    def cross(self) -> float:
        prompts = [tokens(self.rng, self.args.cross_tokens) for _ in range(self.args.cross_prompts)]
        a = SglangEngine(
            self.work, self.model, engine_args={**self.base, **self.linker_args()}, name="cross_a"
        )
        b = SglangEngine(
            self.work, self.model, engine_args={**self.base, **self.linker_args()}, name="cross_b"
        )
        with a, b:
            a.ready(timeout_s=1200)
            b.ready(timeout_s=1200)
            a.generate(prompts, max_new_tokens=1)
            served = b.generate(prompts, max_new_tokens=1)
        stored = sum((len(p) - 1) // PAGE * PAGE for p in prompts)
        print(f"# cross: B cached {[r['cached'] for r in served]} of {stored} stored", flush=True)
        return sum(r["cached"] for r in served) / stored


def require_sglang_python() -> Path:
    try:
        return require_sglang()
    except BaseException as exc:  # pytest's skip outside pytest: say why and stop
        raise SystemExit(f"sglang_ttft: no SGLang environment: {exc}") from None


def backend_importable(python: Path, spec: str) -> bool:
    """Whether MODULE:CLASS imports in the SGLang environment (the backend may not exist)."""
    module, _, name = spec.partition(":")
    probe = f"import importlib; getattr(importlib.import_module({module!r}), {name!r})"
    done = subprocess.run(
        [str(python), "-c", probe],
        env=sglang_environ(cpu_shims=False),
        capture_output=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        print(f"# hicache_backend: skipped, {spec} does not import", flush=True)
    return done.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=8192, help="cached prefix tokens")
    parser.add_argument("--suffix", type=int, default=256, help="new tokens after the prefix")
    parser.add_argument("--reps", type=int, default=3, help="requests per figure (median)")
    parser.add_argument("--layers", type=int, default=2, help="the random model's layers")
    parser.add_argument("--hidden", type=int, default=1024, help="its hidden size")
    parser.add_argument(
        "--intermediate",
        type=int,
        default=20480,
        help="its MLP width (the default gives a 7B's per-token work per unit of attention)",
    )
    parser.add_argument("--heads", type=int, default=8, help="its attention heads")
    parser.add_argument("--kv-heads", type=int, default=4, help="its KV heads")
    parser.add_argument(
        "--cross-prompts", type=int, default=2, help="prompts of the two-engine run"
    )
    parser.add_argument("--cross-tokens", type=int, default=2048, help="tokens of each such prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--backend",
        default="hicache.integrations.sglang:HicacheStorage",
        help="MODULE:CLASS of hicache's HiCache storage backend (skipped when not importable)",
    )
    args = parser.parse_args()
    if args.prefix % PAGE or args.reps < 1:
        parser.error(f"--prefix must be a multiple of {PAGE} and --reps >= 1")
    with tempfile.TemporaryDirectory(prefix="sglang-ttft-") as tmp:
        run = Run(args, Path(tmp))
        with SidecarProcess(run.deploy) as sidecar:
            figures: dict[str, list[tuple[float, int]]] = {}
            figures["recompute"], figures["device_hit"] = run.recompute()
            figures["linker"] = run.flushed_hits("linker", run.linker_args())
            figures["sglang_l2"] = run.sglang_l2()
            file_l3 = {"file_storage_path": str(run.work / "l3"), "prefetch_threshold": PAGE}
            figures["sglang_file_l3"] = run.flushed_hits(
                "sglang_file_l3", run.hicache_args("file", file_l3)
            )
            if backend_importable(run.python, args.backend):
                module, _, name = args.backend.partition(":")
                extra = {
                    "backend_name": "hicache",
                    "module_path": module,
                    "class_name": name,
                    "interface_v1": 1,
                    "config": str(run.deploy),
                    "prefetch_threshold": PAGE,
                }
                figures["hicache_backend"] = run.flushed_hits(
                    "hicache_backend", run.hicache_args("dynamic", extra)
                )
            cross_rate = run.cross()
            ready = sidecar.get("/readyz")[0]
    medians = {name: median_ms(samples) for name, samples in figures.items()}
    print(f"# sidecar /readyz at the end: {ready}")
    backend = medians.get("hicache_backend")
    versus_recompute = round(medians["recompute"] / medians["linker"], 2)
    bound = round(medians["recompute"] / medians["device_hit"], 2)
    if versus_recompute > bound * 1.05:
        print(
            f"# WARNING: ttft_hicache_vs_recompute {versus_recompute} exceeds its bound "
            f"{bound} (SGLang's own device hit): the measurement is wrong",
            flush=True,
        )
    result = {
        "ttft_linker_vs_sglang_l2": round(medians["linker"] / medians["sglang_l2"], 3),
        "ttft_backend_vs_sglang_file_l3": (
            None if backend is None else round(backend / medians["sglang_file_l3"], 3)
        ),
        "ttft_hicache_vs_recompute": versus_recompute,
        "bound_device_hit_vs_recompute": bound,
        "two_engines_cross_hit_rate": round(cross_rate, 4),
        "medians_ms": medians,
        "cached_tokens": {name: [c for _, c in samples] for name, samples in figures.items()},
        "prefix": args.prefix,
        "suffix": args.suffix,
        "reps": args.reps,
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
        },
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
