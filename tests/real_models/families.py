"""The tiny model of each family the real-model tests run: a transformers config built in code
(a few layers, hidden 64, vocab 128, float32), and what the harness must know about it that
neither transformers' cache object nor hicache's layout says.

Windows and chunks are small (8 tokens) so that they matter at the tests' prompt lengths (13 to
48 tokens, pages of 4 and 16). Every family here runs on CPU with transformers' PyTorch
fallbacks (no mamba-ssm, causal-conv1d or flash-linear-attention kernels).

Per family: `make_config()` builds the transformers config; `checkpoint_fields` are what the
family's released checkpoints write instead of transformers 5.x's fields (test_layouts.py reads
both); `chunked_layer_type` names the layers whose keys before the current chunk transformers
keeps but masks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import AutoConfig, PretrainedConfig

VOCAB = 128
WINDOW = 8  # sliding window of the sliding families (tokens)
CHUNK = 8  # Llama 4's attention_chunk_size (tokens)


def _tiny(model_type: str, **fields: Any) -> PretrainedConfig:
    base: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        # larger than the families' 0.02: activations big enough that a wrong state moves the
        # logits well past SENSITIVE
        "initializer_range": 0.1,
    }
    base.update(fields)
    return AutoConfig.for_model(model_type, **base)


@dataclass(frozen=True)
class Family:
    name: str
    make_config: Callable[[], PretrainedConfig]
    checkpoint_fields: dict[str, Any] = field(default_factory=dict)
    chunked_layer_type: str | None = None

    @property
    def has_state(self) -> bool:
        return self.name in STATE_FAMILIES

    @property
    def has_sliding(self) -> bool:
        return self.name in SLIDING_FAMILIES


_MLA = {
    "num_key_value_heads": 4,  # MLA: one latent, expanded to every head
    "head_dim": 8,  # the rope part (qk_rope_head_dim), which is what RoPE rotates
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("llama", lambda: _tiny("llama")),
        Family(
            "gemma3_text",
            lambda: _tiny(
                "gemma3_text",
                sliding_window=WINDOW,
                query_pre_attn_scalar=16,
                layer_types=["sliding_attention", "full_attention"] * 2,
            ),
        ),
        Family(
            "gpt_oss",
            lambda: _tiny(
                "gpt_oss",
                sliding_window=WINDOW,
                num_local_experts=4,
                num_experts_per_tok=2,
                # yarn's original_max_position_embeddings is 4096: stay above it
                max_position_embeddings=8192,
            ),
        ),
        Family(
            "llama4_text",
            lambda: _tiny(
                "llama4_text",
                attention_chunk_size=CHUNK,
                num_local_experts=2,
                num_experts_per_tok=1,
                intermediate_size_mlp=128,
            ),
            chunked_layer_type="chunked_attention",
        ),
        Family(
            "qwen3_next",
            lambda: _tiny(
                "qwen3_next",
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                linear_conv_kernel_dim=4,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
            ),
        ),
        Family(
            "lfm2",
            lambda: _tiny("lfm2", layer_types=["conv", "full_attention"] * 2, conv_L_cache=3),
        ),
        Family(
            "falcon_h1",  # every layer: attention and Mamba-2 side by side
            lambda: _tiny(
                "falcon_h1",
                mamba_n_heads=4,
                mamba_d_head=16,
                mamba_n_groups=1,
                mamba_d_state=16,
                mamba_d_conv=4,
                mamba_expand=1,
                mamba_d_ssm=64,
                mamba_chunk_size=8,
            ),
        ),
        Family(
            "bamba",  # Mamba-2 and attention layers
            lambda: _tiny(
                "bamba",
                attn_layer_indices=[1, 3],
                mamba_n_heads=4,
                mamba_d_head=32,
                mamba_n_groups=1,
                mamba_d_state=16,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_chunk_size=8,
            ),
        ),
        Family(
            "jamba",  # Mamba-1 and attention layers, MoE on odd layers
            lambda: _tiny(
                "jamba",
                attn_layer_period=2,
                attn_layer_offset=1,
                expert_layer_period=2,
                expert_layer_offset=1,
                num_experts=2,
                mamba_d_state=8,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_dt_rank=8,
            ),
        ),
        Family(
            "nemotron_h",  # Mamba-2 at 0 and 3, attention at 1 and 4, an MLP layer at 2
            lambda: _tiny(
                "nemotron_h",
                num_hidden_layers=5,
                hybrid_override_pattern="M*-M*",
                layers_block_type=None,
                mamba_num_heads=4,
                mamba_head_dim=16,
                ssm_state_size=16,
                n_groups=2,
                conv_kernel=4,
                chunk_size=8,
            ),
            # transformers 5.x saves layers_block_type=['linear_attention', 'full_attention',
            # 'mlp', ...] and no num_hidden_layers; the hub's checkpoints
            # (configs/models/nemotron_h_8b.json) hold the pattern string and the count
            checkpoint_fields={"hybrid_override_pattern": "M*-M*", "num_hidden_layers": 5},
        ),
        Family("deepseek_v3", lambda: _tiny("deepseek_v3", **_MLA)),
        Family(
            "deepseek_v32",
            lambda: _tiny("deepseek_v32", **_MLA, index_head_dim=16, index_n_heads=2, index_topk=8),
        ),
    ]
}

STATE_FAMILIES = ("qwen3_next", "lfm2", "falcon_h1", "bamba", "jamba", "nemotron_h")
SLIDING_FAMILIES = ("gemma3_text", "gpt_oss")
