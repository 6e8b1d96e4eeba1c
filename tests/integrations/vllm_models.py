"""Tiny random-weight checkpoints for running hicache's vLLM connector against vLLM's CPU build.

`build_model(kind, out_dir)` writes `out_dir/<name>/config.json` plus `model.safetensors`
(bf16, fixed seed, no tokenizer: vLLM runs with `skip_tokenizer_init=True` and token-id
prompts) and returns that folder. A build is reused when its `hicache_build.json` stamp
matches the recipe, so calling it from every test is cheap; a build is written to a
temporary folder and renamed into place, so an interrupted build is never reused.

Imports only the standard library, torch and transformers (never vllm), so test collection
works without vLLM.

Kinds (`KINDS`) and why each size:

- ``llama``: dense baseline, 2 layers, hidden 128, 4 query / 2 KV heads of 64 (GQA; 64 is a
  head size the CPU attention kernels accept), vocab 512.
- ``gemma3`` (``gemma3_text``): 6 layers S S F S S F with a 64-token sliding window. vLLM
  groups layers of one type into equal-sized KV-cache groups, so 4 sliding + 2 full layers
  give two sliding groups and one full group (as the real Gemma 3 has several sliding
  groups). With vLLM's 128-token CPU block, a 400-600-token prompt has 3-4 blocks out of
  the window, which `request_finished_all_groups` reports as the null block. The LM head
  is untied: Gemma scales input embeddings by sqrt(hidden), and a tied head made greedy
  decoding repeat one token forever.
- ``gpt_oss``: 4 layers alternating sliding (even) / full (odd), window 64, attention sinks,
  a 4-expert top-2 bf16 MoE (the smallest that still routes). vLLM's gpt-oss always builds
  YaRN rope and reads its fields, so they are written (factor 1: plain RoPE).
- ``qwen3_next``: 4 layers L L L F (gated delta net, then full attention, as the default
  `full_attention_interval` 4). The GDN key / value head dim is 128 because the CPU GDN
  kernel refuses anything else; 2 key and 2 value heads keep its state at
  2 x 128 x 128 fp32-sized entries. Full attention: 4 query / 2 KV heads of 64. MoE with
  4 experts top-2 plus a shared expert. vLLM aligns the attention block to the state page,
  so its block grows (to 384 tokens here: every group, state and attention, uses 384).
  The GDN decays are made slow (`_post_init`) so the recurrent state matters after a hit.
- ``lfm2``: 4 layers conv F conv F (short conv, kernel 3, over all 128 channels, and full
  attention with 4 query / 2 KV heads of 32). `conv_dim` and `block_dim` are written into
  config.json because transformers 5.19 drops them and vLLM's LFM2 reads them. A conv
  state only holds the last 2 inputs, so a wrong one shifts logprobs (~0.01) more often
  than tokens: compare logprobs, or keep the suffix after a hit short.

All small kinds: vocab 512, `max_position_embeddings` 4096 (enough for `max_model_len`
2048), `initializer_range` 0.15 (so greedy continuations depend strongly on the prompt
and on every cached token: a wrong KV block changes the output), ~0.2-0.7 M parameters,
each builds in about a second.

``large=True`` (llama only): the TTFT benchmark model. 8 layers, hidden 1024, 8 query / 8
KV heads of 128, MLP 2816, vocab 512: ~95 M parameters (~190 MB bf16), so prefill
dominates (an 8k-token recompute takes seconds on one CPU thread) while its KV is 32 KiB
per token (8 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes); `max_position_embeddings`
16384 allows `max_model_len` >= 9000 (8k cached + 512 new + margin). Its
`initializer_range` is 0.02 (deeper and wider: larger weights would saturate); outputs
still differ between prompts. Measured (one process, 2 cores): engine start 1.9 s,
an 8192-token prefill 5.8 s, the same prompt with a local prefix hit 0.15 s.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

KINDS = ("llama", "gemma3", "gpt_oss", "qwen3_next", "lfm2")

# Bump when a recipe changes, so old builds are rebuilt rather than reused.
_RECIPE_VERSION = 2
_SEED = 0
_STAMP = "hicache_build.json"

# Recommended engine settings for these models (tests may pick smaller values).
MAX_MODEL_LEN = 2048
LARGE_MAX_MODEL_LEN = 9216
SLIDING_WINDOW = 64

_VOCAB = 512
_MAX_POS = 4096
_STD = 0.15


def _llama(large: bool) -> tuple[str, dict[str, Any]]:
    if large:
        return "LlamaConfig", dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=_VOCAB,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=16384,
            initializer_range=0.02,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        )
    return "LlamaConfig", dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=_MAX_POS,
        initializer_range=_STD,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def _gemma3() -> tuple[str, dict[str, Any]]:
    s, f = "sliding_attention", "full_attention"
    return "Gemma3TextConfig", dict(
        architectures=["Gemma3ForCausalLM"],
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        # Untied: Gemma scales the input embedding by sqrt(hidden), so a tied head keeps
        # predicting the last token forever (greedy output "426 426 426 ...").
        tie_word_embeddings=False,
        sliding_window=SLIDING_WINDOW,
        layer_types=[s, s, f, s, s, f],
        max_position_embeddings=_MAX_POS,
        initializer_range=_STD,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )


def _gpt_oss() -> tuple[str, dict[str, Any]]:
    s, f = "sliding_attention", "full_attention"
    return "GptOssConfig", dict(
        architectures=["GptOssForCausalLM"],
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=SLIDING_WINDOW,
        layer_types=[s, f, s, f],
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=_MAX_POS,
        initializer_range=_STD,
        # vLLM's gpt-oss always builds YaRN rope and reads these fields (as the real
        # checkpoint has them); factor 1 keeps it plain RoPE over the 4096 positions.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 1.0,
            "original_max_position_embeddings": _MAX_POS,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def _qwen3_next() -> tuple[str, dict[str, Any]]:
    lin, f = "linear_attention", "full_attention"
    return "Qwen3NextConfig", dict(
        architectures=["Qwen3NextForCausalLM"],
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=[lin, lin, lin, f],
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        max_position_embeddings=_MAX_POS,
        initializer_range=_STD,
        bos_token_id=1,
        eos_token_id=2,
    )


def _lfm2() -> tuple[str, dict[str, Any]]:
    c, f = "conv", "full_attention"
    return "Lfm2Config", dict(
        architectures=["Lfm2ForCausalLM"],
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=[c, f, c, f],
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=3,
        conv_bias=False,
        block_multiple_of=64,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True,
        max_position_embeddings=_MAX_POS,
        initializer_range=_STD,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


# Fields transformers no longer writes but vLLM reads; added to config.json after saving.
_EXTRA_JSON = {"lfm2": {"conv_dim": 128, "block_dim": 128}}


def recipe(kind: str, *, large: bool = False) -> tuple[str, dict[str, Any]]:
    """(transformers config class name, its keyword arguments) for `kind`."""
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; allowed: {', '.join(KINDS)}")
    if large and kind != "llama":
        raise ValueError(f"large=True is only built for 'llama', not {kind!r}")
    if kind == "llama":
        return _llama(large)
    return {"gemma3": _gemma3, "gpt_oss": _gpt_oss, "qwen3_next": _qwen3_next, "lfm2": _lfm2}[
        kind
    ]()


def model_name(kind: str, *, large: bool = False) -> str:
    return f"tiny-{kind}" + ("-large" if large else "")


def build_model(kind: str, out_dir: Path, *, large: bool = False) -> Path:
    """Write (or reuse) the tiny checkpoint for `kind` under `out_dir`; return its folder."""
    cls_name, kwargs = recipe(kind, large=large)
    stamp = {
        "version": _RECIPE_VERSION,
        "seed": _SEED,
        "kind": kind,
        "large": large,
        "config_class": cls_name,
        "kwargs": kwargs,
        "extra_json": _EXTRA_JSON.get(kind, {}),
    }
    out_dir = Path(out_dir)
    target = out_dir / model_name(kind, large=large)
    if _stamp_matches(target, stamp):
        return target

    import torch
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=out_dir))
    os.chmod(tmp, 0o755)
    try:
        config = getattr(transformers, cls_name)(**kwargs)
        with torch.random.fork_rng(devices=[]):  # leave the caller's RNG alone
            torch.manual_seed(_SEED)
            model = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, dtype=torch.float32
            )
            _post_init(kind, model)
        model = model.to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        config_path = tmp / "config.json"
        data = json.loads(config_path.read_text())
        data.update(_EXTRA_JSON.get(kind, {}))
        config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        for extra in ("generation_config.json",):
            (tmp / extra).unlink(missing_ok=True)
        (tmp / _STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _post_init(kind: str, model: Any) -> None:
    """Weight tweaks after the random init (run under the fixed seed)."""
    import torch

    if kind == "qwen3_next":
        # transformers draws A_log = log(U(0.01, 16)) and dt_bias = 1: a GDN state that
        # decays by exp(-A * softplus(a + 1)) per token forgets within a few tokens, so a
        # lost or misplaced state barely changes the output. Slow decays (A in
        # [0.002, 0.02], dt_bias 0: ~100+ tokens of memory) make the recurrent state
        # matter for the whole suffix after a cache hit.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("linear_attn.A_log"):
                    param.copy_(torch.empty_like(param).uniform_(0.002, 0.02).log_())
                elif name.endswith("linear_attn.dt_bias"):
                    param.zero_()


def _stamp_matches(target: Path, stamp: dict[str, Any]) -> bool:
    try:
        found = json.loads((target / _STAMP).read_text())
    except (OSError, ValueError):
        return False
    return found == json.loads(json.dumps(stamp)) and (target / "config.json").is_file()


if __name__ == "__main__":
    import sys

    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/hicache-vllm-models")
    for k in KINDS:
        print(build_model(k, root))
    print(build_model("llama", root, large=True))
