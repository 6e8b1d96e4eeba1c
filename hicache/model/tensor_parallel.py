"""Tensor parallelism: the share of a model's caches one rank holds, derived from the global
layout by one pure function, `shard_layout(layout, tp_size)`, the way the serving engines
(vLLM, SGLang) split them.

Lifecycle: a family rule (or an explicit list) builds the global layout (config.json's head
counts); the deployment's `model.tp_size` (or `hicache layout --tp-size`) shards it once;
every rank of that size holds the same per-rank geometry (the sidecar serves one layout to
all its ranks), and the rank only changes which bytes a page holds, so it is part of the page
keys of every group but the replicated ones.

Rules (checked against vLLM's `QKVParallelLinear` / `get_num_kv_heads` and
`MambaStateShapeCalculator`):
- MHA / GQA (full, sliding, chunked, sparse with K/V heads): kv_heads >= tp_size: each rank
  holds kv_heads / tp_size heads (refused when not divisible); kv_heads < tp_size: each rank
  holds 1 head, replicated on tp_size / kv_heads ranks (refused when tp_size is not a
  multiple of kv_heads). Such a group stays per rank: only some ranks share a head.
- MLA latents (and DeepSeek-V3.2 / GLM-5 indexer keys): the same on every rank, unchanged
  and `replicated_across_ranks` (stored once in L3, served to every rank).
- Mamba-1: d_inner / tp per rank, in conv and ssm. Mamba-2: heads / tp; groups / tp, or, when
  n_groups (1) does not divide tp_size, replicated to tp_size groups (vLLM's
  `extra_groups_for_head_shards`); conv = (d_inner + 2 * groups * d_state) / tp. Gated delta
  net: key and value heads / tp. Lightning attention (MiniMax): heads / tp.
- Any other state cache (no `StateShard` from its family builder: Kimi's KDA, LFM2's short
  conv, explicit state layers) is refused at tp_size > 1, naming the family and layer.
"""

from __future__ import annotations

from dataclasses import replace

from hicache.errors import ConfigError
from hicache.model.layout import ModelLayout
from hicache.model.specs import CacheSpec, KvFormat, LayerSpec, StateShard

TP_SIZE_MAX = 1024


def shard_layout(layout: ModelLayout, tp_size: int) -> ModelLayout:
    """The layout one of `tp_size` tensor-parallel ranks caches. tp_size 1: `layout` itself."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or not 1 <= tp_size <= TP_SIZE_MAX:
        raise ConfigError(f"model.tp_size is {tp_size!r}; allowed: an integer 1..{TP_SIZE_MAX}")
    if layout.tp_size != 1:
        raise ConfigError(
            f"{layout.model_type}: the layout is already one rank's share of tp_size "
            f"{layout.tp_size}; shard the global layout (tp_size 1) instead"
        )
    if tp_size == 1:
        return layout
    layers = []
    for layer in layout.layers:
        caches = tuple(shard_spec(spec, tp_size, layout, layer.layer_id) for spec in layer.caches)
        layers.append(LayerSpec(layer.layer_id, caches, layer.reuses))
    rule = f"{layout.rule}, one rank of tp_size {tp_size}" if layout.rule else ""
    return ModelLayout.build(layout.model_type, layers, layout.source, rule, tp_size=tp_size)


def shard_spec(spec: CacheSpec, tp_size: int, layout: ModelLayout, layer_id: int) -> CacheSpec:
    """One cache's per-rank geometry (`layout` and `layer_id` name it in errors)."""
    where = _where(spec, layout, layer_id)
    if spec.kind.is_token_cache:
        if spec.kv_format is KvFormat.MLA:
            return spec  # the latent (and indexer keys) are whole on every rank
        assert spec.num_kv_heads is not None
        return replace(spec, num_kv_heads=kv_heads_per_rank(spec.num_kv_heads, tp_size, where))
    if spec.shard is None:
        raise ConfigError(
            f"model.tp_size is {tp_size} but {where} has no verified tensor-parallel split "
            f"(state {_shapes(spec)}); allowed: tp_size 1 for this model"
        )
    # every rule splits each tensor's first dim (channels or heads); the rest stay whole
    first_dims = _SHARDERS[spec.shard.rule](spec.shard, tp_size, where)
    if set(first_dims) != {name for name, _ in spec.state_shapes}:  # builder vs rule: a bug
        raise AssertionError(f"{where}: rule {spec.shard.rule!r} split {sorted(first_dims)}")
    shapes = tuple((name, (first_dims[name], *shape[1:])) for name, shape in spec.state_shapes)
    return replace(spec, state_shapes=shapes, shard=None)


def kv_heads_per_rank(kv_heads: int, tp_size: int, where: str = "attention layer") -> int:
    """vLLM's rule: kv_heads / tp_size when tp_size divides it; 1 (replicated on
    tp_size / kv_heads ranks) when tp_size is a multiple of kv_heads; anything else refused."""
    if kv_heads >= tp_size:
        if kv_heads % tp_size:
            raise ConfigError(
                f"model.tp_size {tp_size} does not divide the {kv_heads} KV heads of {where}; "
                f"allowed: a tp_size that divides {kv_heads}, or a multiple of it"
            )
        return kv_heads // tp_size
    if tp_size % kv_heads:
        raise ConfigError(
            f"model.tp_size {tp_size} is above the {kv_heads} KV heads of {where} and not a "
            f"multiple of them, so ranks cannot replicate heads evenly; allowed: a divisor of "
            f"{kv_heads} or a multiple of it"
        )
    return 1


def _divide(total: int, tp_size: int, what: str, where: str) -> int:
    if total % tp_size:
        raise ConfigError(
            f"model.tp_size {tp_size} does not divide the {total} {what} of {where}; allowed: "
            f"a tp_size that divides {total}"
        )
    return total // tp_size


FirstDims = dict[str, int]  # tensor name -> its per-rank first dim


def _mamba1(shard: StateShard, tp: int, where: str) -> FirstDims:
    d_inner = _divide(shard.size("d_inner"), tp, "Mamba channels (d_inner)", where)
    return {"conv": d_inner, "ssm": d_inner}


def _mamba2(shard: StateShard, tp: int, where: str) -> FirstDims:
    n_groups = shard.size("n_groups")
    if n_groups % tp and n_groups != 1:
        raise ConfigError(
            f"model.tp_size {tp} does not divide the {n_groups} Mamba-2 groups of {where}, and "
            "only a single group is replicated across ranks (vLLM's rule); allowed: a tp_size "
            f"that divides {n_groups}"
        )
    groups = n_groups if n_groups % tp == 0 else tp  # one group: a copy on every rank
    conv_dim = shard.size("d_inner") + 2 * groups * shard.size("d_state")
    conv = _divide(conv_dim, tp, "Mamba-2 conv channels", where)
    return {"conv": conv, "ssm": _divide(shard.size("n_heads"), tp, "Mamba-2 heads", where)}


def _gated_delta_net(shard: StateShard, tp: int, where: str) -> FirstDims:
    k_heads = _divide(shard.size("k_heads"), tp, "linear key heads", where)
    v_heads = _divide(shard.size("v_heads"), tp, "linear value heads", where)
    conv = 2 * k_heads * shard.size("k_dim") + v_heads * shard.size("v_dim")
    return {"conv": conv, "recurrent": v_heads}


def _heads(shard: StateShard, tp: int, where: str) -> FirstDims:
    return {"kv": _divide(shard.size("n_heads"), tp, "linear-attention heads", where)}


_SHARDERS = {
    "mamba1": _mamba1,
    "mamba2": _mamba2,
    "gated_delta_net": _gated_delta_net,
    "heads": _heads,
}


def _where(spec: CacheSpec, layout: ModelLayout, layer_id: int) -> str:
    return f"{layout.model_type}'s layer {layer_id} ({spec.describe()})"


def _shapes(spec: CacheSpec) -> str:
    return ", ".join(f"{name} {'x'.join(map(str, shape))}" for name, shape in spec.state_shapes)
