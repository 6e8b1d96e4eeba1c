"""Rules for MLA families: DeepSeek-V2/V3 (Kimi-K2), LongCat-Flash and the DSA sparse families
DeepSeek-V3.2 and GLM-5 (`glm_moe_dsa`).

MLA caches one latent per token: `kv_lora_rank + qk_rope_head_dim` wide (576 for V3).
DeepSeek Sparse Attention keeps the MLA latent plus an indexer key per token
(`index_head_dim`, 128), and no indexer value, in the KV's dtype as transformers caches it.
DeepSeek's inference code, SGLang's DSA pool and vLLM's indexer cache keep that key as
float8_e4m3fn with one float32 scale per 128 dims instead (`model.index_format: fp8_scaled`,
`hicache.model.index_format`): how the key is stored is the engine's choice, not the
config's. MTP layers (`num_nextn_predict_layers`) are not decoder layers of the main model and
are not in the layout. LongCat-Flash runs two MLA
attention sub-layers per decoder block; each has its own cache and its own layer id
(block * 2 + i), as transformers numbers them.
"""

from __future__ import annotations

from hicache.model.families import family
from hicache.model.families.common import ConfigView, mla
from hicache.model.specs import CacheKind, IndexSpec, LayerSpec

_MLA_DEFAULTS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}


@family("deepseek_v3", "deepseek_v2", "kimi_k2")
def deepseek_mla(cfg: ConfigView) -> list[LayerSpec]:
    cfg = cfg.with_defaults(_MLA_DEFAULTS)
    spec = mla(cfg)
    return [LayerSpec(i, (spec,)) for i in range(cfg.num_layers)]


@family("deepseek_v32", "glm_moe_dsa")
def deepseek_sparse(cfg: ConfigView) -> list[LayerSpec]:
    cfg = cfg.with_defaults({**_MLA_DEFAULTS, "index_head_dim": 128})
    spec = mla(cfg, CacheKind.SPARSE, IndexSpec(head_dim=cfg.req_int("index_head_dim")))
    return [LayerSpec(i, (spec,)) for i in range(cfg.num_layers)]


@family("longcat_flash")
def longcat_flash(cfg: ConfigView) -> list[LayerSpec]:
    """`num_layers` blocks (28) of two MLA sub-layers each; a config that gives
    `num_hidden_layers` instead counts sub-layers (transformers keeps num_layers = that // 2)."""
    cfg = cfg.with_defaults(_MLA_DEFAULTS)
    if cfg.has("num_layers") or not cfg.has("num_hidden_layers"):
        blocks = cfg.with_defaults({"num_layers": 28}).req_int("num_layers")
    else:
        blocks = cfg.req_int("num_hidden_layers", minimum=2) // 2
    spec = mla(cfg)
    return [LayerSpec(i, (spec,)) for i in range(2 * blocks)]
