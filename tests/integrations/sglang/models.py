"""Tiny random-weight models for the SGLang tests, built at test time in the SGLang environment
(`python -m tests.integrations.sglang.models KIND OUT`; `engine_harness.tiny_model` runs it).
No tokenizer: the tests send token ids (`skip_tokenizer_init`).

    qwen2   2 layers, 4 query / 2 KV heads of 32, vocab 512 (SGLang's plain dense path)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RECIPES = {
    "qwen2": {
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
}


def build(kind: str, out: Path) -> Path:
    stamp = out / "hicache-recipe.json"
    if stamp.exists() and json.loads(stamp.read_text()) == RECIPES[kind]:
        return out
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**RECIPES[kind], torch_dtype="bfloat16")
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(out)
    stamp.write_text(json.dumps(RECIPES[kind]))
    return out


if __name__ == "__main__":
    build(sys.argv[1], Path(sys.argv[2]))
