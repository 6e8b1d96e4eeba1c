"""The real-model harness: does a model continue from hicache's copy of its cache exactly as it
continues from its own?

For one tiny transformers model (families.py) and one case (prompt A stored, prompt B looked up
and loaded):
1. prefill A page by page (chunks of P tokens) through the model with its own `DynamicCache`,
   recording every attention layer's new K/V (MLA latent, indexer key) as the layer computes it
   — what an engine writes into its paged pool — and, after every chunk, every state layer's
   conv / recurrent / SSM state (snapshots at page boundaries, as vLLM's
   `mamba_cache_mode=align` keeps them);
2. copy that into hicache's device pools (one slot per token, page p = slots p*P..p*P+P-1;
   one slot per state snapshot), store A (token groups: a device page per full page, None for
   a page the engine freed; state groups: `{num_tokens: slot}`), then fill every device pool
   with NaN, so that anything hicache does not load shows;
3. look up and load B (B[:-1] when B is A: the engine computes the last token itself), rebuild
   a fresh `DynamicCache` for the hit from the loaded pages only — what transformers keeps:
   every token for full / MLA layers, the window's tail for sliding layers, the current chunk
   for chunked layers (the earlier tokens it keeps but masks get finite garbage), the loaded
   snapshot for state layers (a conv column transformers keeps but never reads gets garbage);
4. continue B[hit:] in one forward from that cache, and from THE REFERENCE: a fresh cache
   prefilled page by page on B[:hit] exactly as A was. The logits must be bit-identical
   (TOLERANCE is 0), and the hit must be the one the case expects.

NaN in anything the model reads poisons the logits, so a page or snapshot hicache did not
load, or loaded into the wrong place, fails the comparison; garbage in what the model must not
read proves it does not read it. `SENSITIVE` is the margin the defect detectors require: a
wrong snapshot or a misplaced page must move the logits by more than that.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import (
    CacheLayerMixin,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)

from hicache.assembly import by_key
from hicache.memory import DevicePool
from hicache.model import LayerMap, load_layout
from hicache.model.layout import CacheGroup
from tests.real_models.families import VOCAB, Family

transformers.logging.set_verbosity_error()

# restored vs reference logits: bit-identical. The loaded bytes are the model's own and the
# continuation runs the same ops, so any difference is a wrong byte; the 1e-5 bar would let a
# swap of two cached pages through (RoPE'd full attention moved ~1e-6 when two were swapped)
TOLERANCE = 0.0
SENSITIVE = 1e-3  # what a wrong snapshot or a misplaced page must move the logits by, at least
GARBAGE_SCALE = 10.0  # finite garbage for what transformers keeps but must not read

Pools = Mapping[str, DevicePool]


# ---- the tiny model --------------------------------------------------------------------------


@dataclass
class TinyModel:
    family: Family
    model: PreTrainedModel
    config_path: Path  # transformers' `save_pretrained` config.json, which hicache reads
    layer_map: LayerMap
    # transformers' states after a short prefill: layer -> conv / recurrent shape (no batch)
    state_shapes: dict[int, dict[str, tuple[int, ...]]]
    kv_format: str  # "mha", or "mla": the layers cache a latent and a rope key

    @property
    def name(self) -> str:
        return self.family.name

    def groups(self) -> tuple[CacheGroup, ...]:
        return self.layer_map.groups


def build_model(family: Family, directory: Path) -> TinyModel:
    """The family's tiny model (seed 0, float32, eval), its saved config.json and hicache's
    layer map of that file."""
    config = family.make_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    model.config.save_pretrained(directory)
    config_path = directory / "config.json"
    layer_map = LayerMap(load_layout(config_path))
    probe = prefill(model, list(range(1, 6)), 4)
    state_shapes = {
        layer_id: {name: tuple(t.shape) for name, t in states.items()}
        for layer_id, states in probe.states[5].items()
    }
    mla = getattr(model.config, "kv_lora_rank", None) is not None
    return TinyModel(family, model, config_path, layer_map, state_shapes, "mla" if mla else "mha")


# ---- prompts and cases -----------------------------------------------------------------------


def tokens_for(seed_text: str, count: int) -> list[int]:
    gen = torch.Generator().manual_seed(zlib.crc32(seed_text.encode()))
    return torch.randint(1, VOCAB, (count,), generator=gen).tolist()


@dataclass(frozen=True)
class Case:
    """Store `a`, then look up and load `lookup` (B, or B[:-1] when B is A) and continue B from
    the hit. `freed`: page positions of A the engine no longer holds when it stores, per cache
    kind ("sliding", "chunked"), passed as None. `snapshot_of`: which state each stored
    snapshot really holds, by its label (the defect detector labels the state after 14 tokens
    as 12); by default the state after exactly the label. `earlier`: lengths of prefixes of A
    stored first, one store each (earlier turns of a conversation), all their pages kept."""

    name: str
    page: int
    a: tuple[int, ...]
    b: tuple[int, ...]
    lookup: tuple[int, ...]
    expect_hit: int
    freed: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    snapshot_of: Mapping[int, int] = field(default_factory=dict)
    earlier: tuple[int, ...] = ()

    @property
    def stores(self) -> list[tuple[int, ...]]:
        """The prompts stored, in order: the earlier turns, then A."""
        return [self.a[:n] for n in self.earlier] + [self.a]

    def __str__(self) -> str:
        return self.name


def make_case(
    name: str,
    page: int,
    a_len: int,
    *,
    hit: int,
    extend: int = 0,
    diverge_at: int | None = None,
    exact: bool = False,
    freed: Mapping[str, tuple[int, ...]] | None = None,
    snapshot_of: Mapping[int, int] | None = None,
    earlier: tuple[int, ...] = (),
) -> Case:
    """B = A + `extend` new tokens; or A[:diverge_at] + new tokens (B differs from A at
    diverge_at); or A itself (`exact`: lookup B[:-1])."""
    a = tokens_for(name + "/a", a_len)
    if exact:
        b = list(a)
    elif diverge_at is not None:
        tail = tokens_for(name + "/b", a_len - diverge_at + 3)
        tail[0] = a[diverge_at] % (VOCAB - 1) + 1  # differs from A there, never 0
        b = a[:diverge_at] + tail
    else:
        b = a + tokens_for(name + "/b", extend)
    lookup = b[:-1] if exact else b
    return Case(
        name, page, tuple(a), tuple(b), tuple(lookup), hit, freed or {}, snapshot_of or {}, earlier
    )


# ---- prefill with recording ------------------------------------------------------------------


@dataclass
class Prefill:
    """A page-by-page prefill: the model's own cache, each attention layer's K/V per token (as
    the layer computed it), each state layer's state after every chunk."""

    tokens: list[int]
    page: int
    cache: DynamicCache
    keys: dict[int, torch.Tensor]  # layer -> [T, heads, dim] (MLA: the latent, heads = 1)
    values: dict[int, torch.Tensor]  # layer -> [T, heads, dim] (MLA: the rope key)
    indexer_keys: dict[int, torch.Tensor]  # layer -> [T, dim]
    states: dict[int, dict[int, dict[str, torch.Tensor]]]  # tokens done -> layer -> conv / rec


def _record(
    layer: Any,
    layer_id: int,
    keys: dict[int, list[torch.Tensor]],
    values: dict[int, list[torch.Tensor]],
    index: dict[int, list[torch.Tensor]],
) -> None:
    """Wrap one cache layer's `update` (and `update_indexer`) to keep a copy of what each
    forward hands it: the new tokens' K/V (MLA latent and rope key; indexer key)."""
    if isinstance(layer, CacheLayerMixin):
        update = layer.update

        def recording_update(
            key_states: torch.Tensor, value_states: torch.Tensor, *a: Any, **k: Any
        ) -> Any:
            keys.setdefault(layer_id, []).append(key_states.detach().clone())
            values.setdefault(layer_id, []).append(value_states.detach().clone())
            return update(key_states, value_states, *a, **k)

        layer.update = recording_update
    if isinstance(layer, DynamicIndexedLayer):
        update_indexer = layer.update_indexer

        def recording_indexer(indexer_key_states: torch.Tensor) -> torch.Tensor:
            index.setdefault(layer_id, []).append(indexer_key_states.detach().clone())
            return update_indexer(indexer_key_states)

        layer.update_indexer = recording_indexer


def _states(cache: DynamicCache) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for layer_id, layer in enumerate(cache.layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        if not layer.is_conv_states_initialized[0]:
            continue  # an MLP / MoE layer: no state
        states = {"conv": layer.conv_states[0][0].detach().clone()}
        if layer.is_recurrent_states_initialized[0]:
            states["recurrent"] = layer.recurrent_states[0][0].detach().clone()
        out[layer_id] = states
    return out


def prefill(model: PreTrainedModel, tokens: Sequence[int], page: int) -> Prefill:
    cache = DynamicCache(config=model.config)
    keys: dict[int, list[torch.Tensor]] = {}
    values: dict[int, list[torch.Tensor]] = {}
    index: dict[int, list[torch.Tensor]] = {}
    for layer_id, layer in enumerate(cache.layers):
        _record(layer, layer_id, keys, values, index)
    states: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    done = 0
    with torch.no_grad():
        while done < len(tokens):
            chunk = list(tokens[done : done + page])
            model(input_ids=torch.tensor([chunk]), past_key_values=cache, use_cache=True)
            done += len(chunk)
            states[done] = _states(cache)
    return Prefill(
        list(tokens),
        page,
        cache,
        {i: torch.cat(k, dim=-2)[0].transpose(0, 1) for i, k in keys.items()},
        {i: torch.cat(v, dim=-2)[0].transpose(0, 1) for i, v in values.items()},
        {i: torch.cat(x, dim=1)[0] for i, x in index.items()},
        states,
    )


def continue_logits(
    model: PreTrainedModel, cache: DynamicCache, tokens: Sequence[int]
) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(tokens)]), past_key_values=cache, use_cache=True)
    return out.logits[0]


def max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got - want).abs().max().item()
    return math.inf if math.isnan(diff) else diff


# ---- transformers' tensors <-> hicache's slots ----------------------------------------------


def token_tensors(tm: TinyModel, pre: Prefill, layer_id: int) -> dict[str, torch.Tensor]:
    """One layer's per-token tensors as hicache names them, `[T, *slot shape]`: MHA "k", "v";
    MLA "kv" = [latent | rope key] (as vLLM and SGLang keep it); "index_k" for the indexer."""
    if tm.kv_format == "mla":
        out = {"kv": torch.cat([pre.keys[layer_id], pre.values[layer_id]], dim=-1)}
    else:
        out = {"k": pre.keys[layer_id], "v": pre.values[layer_id]}
    if layer_id in pre.indexer_keys:
        out["index_k"] = pre.indexer_keys[layer_id].unsqueeze(1)
    return out


def state_name(group: CacheGroup, tensor: str) -> str:
    """transformers' name of a hicache state tensor: "conv" is the conv state, the one other
    tensor (GDN "recurrent", Mamba "ssm") the recurrent state."""
    if tensor == "conv":
        return "conv"
    others = [n for n, _ in group.spec.state_shapes if n != "conv"]
    if others != [tensor]:
        raise AssertionError(
            f"group {group.name!r} has state tensors {[n for n, _ in group.spec.state_shapes]}; "
            "the harness maps 'conv' and one recurrent tensor"
        )
    return "recurrent"


def state_to_slot(
    group: CacheGroup, tensor: str, value: torch.Tensor, shape: tuple[int, ...]
) -> torch.Tensor:
    """transformers' state (no batch) as hicache's slot. A conv state transformers keeps
    `kernel` columns wide (the first one is never read: the kernel spans it and the new token)
    goes in as its last `shape[-1]` columns."""
    if tensor == "conv" and value.shape[:-1] == shape[:-1] and value.shape[-1] >= shape[-1]:
        return value[..., value.shape[-1] - shape[-1] :]
    if tuple(value.shape) != shape:
        raise AssertionError(
            f"group {group.name!r} tensor {tensor!r}: hicache's slot is {shape}, transformers' "
            f"state is {tuple(value.shape)}"
        )
    return value


def slot_to_state(slot: torch.Tensor, want: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """hicache's slot as transformers' state of shape `want`: columns transformers keeps but
    hicache does not get finite garbage (it must never be read)."""
    if tuple(slot.shape) == want:
        return slot.clone()
    out = garbage(want, gen)
    out[..., want[-1] - slot.shape[-1] :] = slot
    return out


def garbage(shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=gen) * GARBAGE_SCALE


# ---- the engine's side: pools in, pools out --------------------------------------------------


def token_pages_for_store(
    tm: TinyModel, case: Case, prompt: Sequence[int], top: Mapping[str, int]
) -> dict[str, list[int | None]]:
    """A device page per full page of `prompt`, from `top[group]` down (stores use the pool's
    end, loads its start, so a load never finds its bytes in place by chance); None where the
    case frees the page (A's store only)."""
    full = len(prompt) // case.page
    out: dict[str, list[int | None]] = {}
    for group in tm.groups():
        if group.kind.is_token_cache:
            freed = (
                set(case.freed.get(group.kind.value, ())) if len(prompt) == len(case.a) else set()
            )
            out[group.name] = [None if i in freed else top[group.name] - i for i in range(full)]
    return out


def write_tokens(
    tm: TinyModel, pools: Pools, pre: Prefill, pages: Mapping[str, Sequence[int | None]]
) -> None:
    page = pre.page
    for group in tm.groups():
        if not group.kind.is_token_cache:
            continue
        pool = pools[group.name]
        for local, layer_id in enumerate(group.layer_ids):
            tensors = token_tensors(tm, pre, layer_id)
            for name, shape in pool.geometry.tensors:
                if name not in tensors or tuple(tensors[name].shape[1:]) != shape:
                    raise AssertionError(
                        f"{tm.name} layer {layer_id}: hicache group {group.name!r} keeps "
                        f"{list(pool.geometry.tensors)}; transformers' cache gives "
                        f"{[(n, tuple(t.shape[1:])) for n, t in tensors.items()]}"
                    )
                src = tensors[name]
                for p, d in enumerate(pages[group.name]):
                    if d is not None:
                        pool.tensors[local][name][d * page : (d + 1) * page] = src[
                            p * page : (p + 1) * page
                        ]


def write_snapshots(
    tm: TinyModel, pools: Pools, pre: Prefill, case: Case, first_slot: int = 0
) -> dict[str, dict[int, int]]:
    """Every page boundary of the prefilled prompt as a snapshot in its own slot (first_slot,
    first_slot + 1, ...); returns the store's `snapshots` argument. `case.snapshot_of` may say
    a label holds another length's state."""
    page = case.page
    labels = [n for n in range(page, len(pre.tokens) + 1, page)]
    out: dict[str, dict[int, int]] = {}
    for group in tm.groups():
        if group.kind.is_token_cache:
            continue
        pool = pools[group.name]
        out[group.name] = {}
        for slot, label in enumerate(labels, first_slot):
            source = case.snapshot_of.get(label, label)
            for local, layer_id in enumerate(group.layer_ids):
                states = pre.states[source][layer_id]
                for name, shape in pool.geometry.tensors:
                    value = states[state_name(group, name)]
                    pool.tensors[local][name][slot] = state_to_slot(group, name, value, shape)
            out[group.name][label] = slot
    return out


def fill_nan(pools: Pools) -> None:
    for pool in pools.values():
        for layer in pool.tensors:
            for t in layer.values():
                t.fill_(float("nan"))


def load_pages(
    tm: TinyModel, tokens: Sequence[int], page: int, sizes: Mapping[str, int]
) -> dict[str, list[int]]:
    """A device page per full page of the looked-up prompt, from page 0 (the store used the
    pool's end); the pool's last slot for a state group's snapshot (the store used 0..)."""
    full = len(tokens) // page
    return {
        g.name: list(range(full)) if g.kind.is_token_cache else [sizes[g.name] - 1]
        for g in tm.groups()
    }


def _read_tokens(
    pool: DevicePool, local: int, name: str, pages: Sequence[int], page: int
) -> torch.Tensor:
    rows = [pool.tensors[local][name][d * page : (d + 1) * page] for d in pages]
    return torch.cat(rows) if rows else pool.tensors[local][name][:0]


def restore(
    tm: TinyModel,
    pools: Pools,
    pages: Mapping[str, Sequence[int]],
    hit: int,
    page: int,
    *,
    misplace: tuple[int, int] | None = None,
) -> DynamicCache:
    """A fresh transformers cache for the first `hit` tokens from what the pools hold at
    `pages` — no other source. `misplace=(i, j)` reads page position i's device page in
    position j's place too (the sensitivity check: a page overwritten by another's bytes).
    Two pages merely swapped would not do: full attention over RoPE'd keys is blind to the
    order of the cached keys (it moved the logits by ~1e-6)."""
    gen = torch.Generator().manual_seed(1234)
    cache = DynamicCache(config=tm.model.config)
    config = tm.model.config
    layer_types = getattr(config, "layer_types", None) or []
    hit_pages = hit // page
    for layer_id, layer in enumerate(cache.layers):
        slots = tm.layer_map.slots(layer_id) if layer_id in tm.layer_map.stage_layer_ids else ()
        token_slot = next((s for s in slots if s.group.kind.is_token_cache), None)
        state_slot = next((s for s in slots if not s.group.kind.is_token_cache), None)
        if isinstance(layer, CacheLayerMixin):
            if token_slot is None:
                raise AssertionError(
                    f"{tm.name} layer {layer_id}: transformers caches it as "
                    f"{type(layer).__name__}; hicache's layout gives it no token cache"
                )
            group = token_slot.group
            pool = pools[group.name]
            order = list(pages[group.name][:hit_pages])
            if misplace is not None and max(misplace) < len(order):
                order[misplace[1]] = order[misplace[0]]
            tensors = {
                name: _read_tokens(pool, token_slot.local_id, name, order, page)
                for name, _ in pool.geometry.tensors
            }
            keep, masked = hit, 0
            if isinstance(layer, DynamicSlidingWindowLayer):
                # sliding and chunked layers alike keep the last window-1 tokens (a chunked
                # layer's "window" is its chunk); a chunked one reads only its current chunk
                keep = min(hit, layer.sliding_window - 1)
                if layer_types and layer_types[layer_id] == tm.family.chunked_layer_type:
                    chunk_start = hit // layer.sliding_window * layer.sliding_window
                    masked = max(0, chunk_start - (hit - keep))
            _set_attention(tm, layer, tensors, hit, keep, masked, gen)
        if layer_id in tm.state_shapes and state_slot is None:
            raise AssertionError(
                f"{tm.name} layer {layer_id}: transformers keeps state "
                f"{tm.state_shapes[layer_id]}; hicache's layout gives it no state group"
            )
        if isinstance(layer, LinearAttentionCacheLayerMixin) and state_slot is not None:
            group = state_slot.group
            pool = pools[group.name]
            slot = pages[group.name][0]
            conv = rec = None
            for name, _ in pool.geometry.tensors:
                value = pool.tensors[state_slot.local_id][name][slot]
                kind = state_name(group, name)
                state = slot_to_state(value, tm.state_shapes[layer_id][kind], gen).unsqueeze(0)
                if kind == "conv":
                    conv = state
                else:
                    rec = state
            assert conv is not None
            layer.lazy_initialization(
                conv_states=conv, state_idx=0, conv_kernel_size=conv.shape[-1]
            )
            layer.conv_states[0].copy_(conv)
            if rec is not None:
                layer.lazy_initialization(recurrent_states=rec, state_idx=0)
                layer.recurrent_states[0].copy_(rec)
            layer.has_previous_state[0] = True
    assert cache.get_seq_length() == hit, (cache.get_seq_length(), hit)
    return cache


def _set_attention(
    tm: TinyModel,
    layer: Any,
    tensors: dict[str, torch.Tensor],
    hit: int,
    keep: int,
    masked: int,
    gen: torch.Generator,
) -> None:
    """Put the last `keep` of `hit` tokens into a transformers attention layer; the first
    `masked` of them (before the current chunk: kept, never read) as garbage."""

    def tail(t: torch.Tensor) -> torch.Tensor:
        t = t[hit - keep : hit].clone()
        if masked:
            t[:masked] = garbage(t[:masked].shape, gen)
        return t

    if tm.kv_format == "mla":
        rank = tm.model.config.kv_lora_rank
        kv = tail(tensors["kv"]).transpose(0, 1).unsqueeze(0)  # [1, 1, keep, rank + rope]
        keys, values = kv[..., :rank].contiguous(), kv[..., rank:].contiguous()
    else:
        keys = tail(tensors["k"]).transpose(0, 1).unsqueeze(0).contiguous()
        values = tail(tensors["v"]).transpose(0, 1).unsqueeze(0).contiguous()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    if isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = hit
    if isinstance(layer, DynamicIndexedLayer):
        index = tail(tensors["index_k"])[:, 0, :].unsqueeze(0).contiguous()  # [1, keep, dim]
        layer.lazy_initialization_indexer(index)
        layer.indexer_keys = index
    assert isinstance(layer, DynamicLayer)


def cache_differences(got: DynamicCache, want: DynamicCache) -> list[str]:
    """Per layer, what differs between a restored cache and the reference (finite garbage in
    unread places shows here too; NaN means hicache did not load something read)."""
    out = []
    for layer_id, (g, w) in enumerate(zip(got.layers, want.layers, strict=True)):
        pairs = []
        if isinstance(w, CacheLayerMixin) and getattr(w, "keys", None) is not None:
            pairs += [("keys", g.keys, w.keys), ("values", g.values, w.values)]
        if isinstance(w, DynamicIndexedLayer) and w.indexer_keys is not None:
            pairs.append(("indexer_keys", g.indexer_keys, w.indexer_keys))
        if isinstance(w, LinearAttentionCacheLayerMixin) and w.is_conv_states_initialized[0]:
            if g.conv_states[0] is None:
                out.append(f"layer {layer_id}: no conv state restored")
                continue
            pairs.append(
                ("conv (last kernel-1 cols)", g.conv_states[0][..., 1:], w.conv_states[0][..., 1:])
            )
            if w.is_recurrent_states_initialized[0]:
                pairs.append(("recurrent", g.recurrent_states[0], w.recurrent_states[0]))
        for what, a, b in pairs:
            if a is None or a.shape != b.shape:
                out.append(
                    f"layer {layer_id} {what}: shape {None if a is None else tuple(a.shape)} vs {tuple(b.shape)}"
                )
            elif not torch.equal(a, b):
                out.append(f"layer {layer_id} {what}: max diff {max_diff(a, b):.3g}")
    return out


# ---- one case through the embedded cache -----------------------------------------------------


@dataclass
class Outcome:
    case: Case
    lookup_tokens_l2: int
    lookup_tokens_total: int
    loaded_tokens: int  # 0 when nothing hit (no handle)
    pages_stored: int
    diff: float | None  # restored vs reference logits; None when nothing hit
    details: list[str] = field(default_factory=list)

    def message(self) -> str:
        diff = "NaN (the model read something not loaded)" if self.diff == math.inf else self.diff
        return (
            f"case {self.case.name}: hit {self.loaded_tokens} (lookup L2 {self.lookup_tokens_l2}, "
            f"total {self.lookup_tokens_total}, expected {self.case.expect_hit}), max |logit "
            f"diff| {diff}; cache differences: {self.details or 'none'}"
        )


def pool_sizes(tm: TinyModel, case: Case) -> dict[str, int]:
    """Room for every store's pages (and snapshots) and the load's, apart."""
    stored = sum(len(p) // case.page for p in case.stores)
    pages = stored + len(case.lookup) // case.page + 2
    return {g.name: pages if g.kind.is_token_cache else stored + 2 for g in tm.groups()}


def staged_stores(
    tm: TinyModel, pools: Pools, case: Case, sizes: Mapping[str, int]
) -> Iterator[tuple[Prefill, dict[str, list[int | None]], dict[str, dict[int, int]]]]:
    """For each of `case.stores` in turn: prefill it, write it into pool pages and snapshot
    slots of its own, and yield (prefill, the store's device pages, its snapshots); the caller
    stores it before taking the next."""
    top = {name: n - 1 for name, n in sizes.items()}
    first_slot = 0
    for prompt in case.stores:
        pre = prefill(tm.model, prompt, case.page)
        pages = token_pages_for_store(tm, case, prompt, top)
        write_tokens(tm, pools, pre, pages)
        yield pre, pages, write_snapshots(tm, pools, pre, case, first_slot)
        full = len(prompt) // case.page
        top = {name: t - full for name, t in top.items()}
        first_slot += full


def write_held_pages(
    tm: TinyModel, pools: Pools, pre: Prefill, dev: Mapping[str, Sequence[int]], skip: int
) -> None:
    """The engine's own copy of the first `skip` pages, in the load's pages (`skip_pages`)."""
    full = len(pre.tokens) // pre.page
    held = {
        g.name: [dev[g.name][i] if i < skip else None for i in range(full)]
        for g in tm.groups()
        if g.kind.is_token_cache
    }
    write_tokens(tm, pools, pre, held)


def compare(tm: TinyModel, case: Case, restored: DynamicCache, hit: int) -> tuple[float, list[str]]:
    """Continue B[hit:] from the restored cache and from THE REFERENCE; the max |logit diff|
    and, when it is over TOLERANCE, what differs between the two caches before continuing."""
    ref = prefill(tm.model, case.b[:hit], case.page)
    details = cache_differences(restored, ref.cache)
    got = continue_logits(tm.model, restored, case.b[hit:])
    want = continue_logits(tm.model, ref.cache, case.b[hit:])
    diff = max_diff(got, want)
    return diff, details if diff > TOLERANCE else []


async def run_embedded(
    tm: TinyModel,
    case: Case,
    *,
    l3_dir: Path | None = None,
    host_layout: str = "layer_first",
    misplace: tuple[int, int] | None = None,
    skip_pages: int = 0,
) -> Outcome:
    """Store A, NaN the pools, look up and load, restore, continue, compare (module doc).
    With `l3_dir`, L2 is emptied after the store so the load comes from L3. `skip_pages`: the
    engine holds the first pages itself (written back after the NaN fill) and loads the rest."""
    from hicache.storage import FileBackend, GuardedStore

    sizes = pool_sizes(tm, case)
    embedded = by_key.embedded(
        tm.layer_map,
        dtype=torch.float32,
        page_size_tokens=case.page,
        host_capacity_bytes=8 << 20,  # hundreds of these tiny pages
        device_pages=sizes,
        host_layout=host_layout,  # type: ignore[arg-type]
    )
    store = None
    if l3_dir is not None:
        store = GuardedStore(FileBackend(l3_dir, capacity_bytes=1 << 30))
    cache = by_key.tiered(
        embedded,
        store=store,
        prefetch_policy="wait_complete" if store is not None else "best_effort",
    )
    pools = embedded.device_pools
    try:
        async with cache.running():
            stored = 0
            for pre, pages, snapshots in staged_stores(tm, pools, case, sizes):
                result = await cache.store(pre.tokens, pages, snapshots=snapshots)
                stored += result.pages_stored
            if l3_dir is not None:
                await cache.drain()  # L3 is written behind the acked stores
                cache.clear_l2()
            fill_nan(pools)
            hit = cache.lookup(case.lookup)
            dev = load_pages(tm, case.lookup, case.page, sizes)
            write_held_pages(tm, pools, pre, dev, skip_pages)
            handle, loaded = await cache.load(case.lookup, dev, skip_pages=skip_pages)
            if handle is None:
                return Outcome(case, hit.tokens_l2, hit.tokens_total, 0, stored, None)
            await asyncio.to_thread(
                lambda: [handle.wait_layer(i) for i in tm.layer_map.stage_layer_ids]
            )
            result = await handle.done()
            assert result.ok, f"load ended {result.state}: {result.error}"
            restored = restore(tm, pools, dev, loaded.tokens_total, case.page, misplace=misplace)
    finally:
        embedded.close()
    diff, details = compare(tm, case, restored, loaded.tokens_total)
    return Outcome(
        case,
        hit.tokens_l2,
        hit.tokens_total,
        loaded.tokens_total,
        stored,
        diff,
        details,
    )


class Zoo:
    """Each family's tiny model, built once (the session's fixture)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._built: dict[str, TinyModel] = {}

    def get(self, name: str) -> TinyModel:
        from tests.real_models.families import FAMILIES

        if name not in self._built:
            self._built[name] = build_model(FAMILIES[name], self.directory / name)
        return self._built[name]


# ---- hicache's layout against transformers' cache --------------------------------------------


def layout_mismatches(tm: TinyModel, layer_map: LayerMap) -> list[str]:
    """Layer by layer, where hicache's layout (`layer_map`) does not describe the cache
    transformers makes: its attention caches (kind, window / chunk, per-token tensors and their
    shapes) and its state tensors. A conv state may be narrower in hicache than in
    transformers (transformers keeps `kernel` columns, of which the model reads the last
    kernel-1; `conv_width_mismatches` holds hicache to those); every other shape must match."""
    from hicache.model import CacheKind

    probe = prefill(tm.model, list(range(1, 6)), 4)
    layer_types = getattr(tm.model.config, "layer_types", None) or []
    out = []
    for layer_id, layer in enumerate(probe.cache.layers):
        slots = layer_map.slots(layer_id) if layer_id < layer_map.layout.num_layers else ()
        token = [s.group for s in slots if s.group.kind.is_token_cache]
        state = [s.group for s in slots if not s.group.kind.is_token_cache]
        kind_name = layer_types[layer_id] if layer_id < len(layer_types) else "-"
        where = f"layer {layer_id} (transformers {type(layer).__name__}, {kind_name})"
        if isinstance(layer, CacheLayerMixin):
            if len(token) != 1:
                out.append(f"{where}: hicache token groups {[g.name for g in token]}; want one")
            else:
                group = token[0]
                spec = group.spec
                want_kind, window, chunk = CacheKind.FULL, None, None
                if isinstance(layer, DynamicIndexedLayer):
                    want_kind = CacheKind.SPARSE
                elif isinstance(layer, DynamicSlidingWindowLayer):
                    if kind_name == tm.family.chunked_layer_type:
                        want_kind, chunk = CacheKind.CHUNKED, layer.sliding_window
                    else:
                        want_kind, window = CacheKind.SLIDING, layer.sliding_window
                have = (spec.kind, spec.window_tokens, spec.chunk_tokens)
                if have != (want_kind, window, chunk):
                    out.append(
                        f"{where}: hicache group {group.name!r} is (kind, window, chunk) = "
                        f"{have}; transformers' is {(want_kind, window, chunk)}"
                    )
                want = {
                    n: tuple(t.shape[1:]) for n, t in token_tensors(tm, probe, layer_id).items()
                }
                got = dict(spec.token_tensors())
                if got != want:
                    out.append(
                        f"{where}: hicache group {group.name!r} keeps per token {got}; "
                        f"transformers' cache holds {want}"
                    )
        elif token:
            out.append(f"{where}: no attention cache in transformers; hicache has {token}")
        states = probe.states[5].get(layer_id)
        if not states:
            if state:
                out.append(f"{where}: no state in transformers; hicache keeps {state[0].name!r}")
            continue
        if len(state) != 1:
            out.append(
                f"{where}: transformers keeps {sorted(states)}; hicache state groups {state}"
            )
            continue
        group = state[0]
        have_names = {state_name(group, n) for n, _ in group.spec.state_shapes}
        if have_names != set(states):
            out.append(
                f"{where}: hicache keeps {dict(group.spec.state_shapes)}; transformers {sorted(states)}"
            )
            continue
        for name, shape in group.spec.state_shapes:
            value = tuple(states[state_name(group, name)].shape)
            fits = value == shape or (
                name == "conv" and value[:-1] == shape[:-1] and value[-1] >= shape[-1]
            )
            if not fits:
                out.append(
                    f"{where}: hicache group {group.name!r} tensor {name!r} is {shape}; "
                    f"transformers' is {value}"
                )
    return out


def conv_width_mismatches(tm: TinyModel) -> list[str]:
    """hicache's conv states must be the kernel-1 columns the model reads (transformers keeps
    `kernel` columns and never reads the first; vLLM and SGLang allocate kernel-1)."""
    out = []
    for group in tm.groups():
        shapes = dict(group.spec.state_shapes)
        if "conv" not in shapes:
            continue
        for layer_id in group.layer_ids:
            kernel = tm.state_shapes[layer_id]["conv"][-1]
            if shapes["conv"][-1] != kernel - 1:
                out.append(
                    f"group {group.name!r} layer {layer_id}: hicache conv {shapes['conv']}; "
                    f"transformers keeps {tm.state_shapes[layer_id]['conv']} (kernel {kernel}) "
                    f"and reads the last {kernel - 1} columns"
                )
    return out


# ---- one case through a real sidecar process -------------------------------------------------


def sidecar_deployment(tm: TinyModel, directory: Path, page: int) -> Path:
    """A deployment YAML for `hicache serve` on the tiny model's saved config: float32, file
    L3 in `directory`, loads waiting for L3 (so a load after L2 is emptied comes from L3)."""
    import yaml

    directory.mkdir(parents=True, exist_ok=True)
    data = {
        "model": {"config_path": str(tm.config_path), "dtype": "float32", "page_size_tokens": page},
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": "16MiB"},
        "storage": {"kind": "file", "path": str(directory / "l3")},
        "cache": {"prefetch_policy": "wait_complete"},
        # Unix socket paths are limited to ~108 bytes: the socket lives in the short directory
        # admin_without_token: the L3 tests empty L2 through /v1/admin/clear (loopback, no token)
        "service": {
            "socket_path": str(directory / "e.sock"),
            "http_port": 0,
            "admin_without_token": True,
        },
    }
    path = directory / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_sidecar(
    tm: TinyModel,
    case: Case,
    socket: str,
    *,
    tenant: str,
    after_store: Any = None,
) -> Outcome:
    """`run_embedded` through a sidecar: this process is the engine, speaking only through
    `hicache.client` and the shared pool file. `tenant` keeps each case's pages apart;
    `after_store()` runs between the store and the NaN fill (e.g. emptying L2)."""
    from hicache.client import connect

    sizes = pool_sizes(tm, case)
    client = connect(
        socket,
        tm.layer_map,
        dtype="float32",
        page_size_tokens=case.page,
        tenant=tenant,
        engine="real-models",
    )
    try:
        shared = client.create_pools(sizes)
        client.register_pools(shared)
        pools = shared.device_pools()
        stored = 0
        for pre, pages, snapshots in staged_stores(tm, pools, case, sizes):
            stored += client.store(pre.tokens, pages, snapshots=snapshots)["pages_stored"]
        if after_store is not None:
            after_store()
        fill_nan(pools)
        hit = client.lookup(case.lookup)
        dev = load_pages(tm, case.lookup, case.page, sizes)
        handle = client.load(case.lookup, dev)
        if handle is None:
            return Outcome(case, hit.tokens_l2, hit.tokens_total, 0, stored, None)
        for layer_id in tm.layer_map.stage_layer_ids:
            handle.wait_layer(layer_id)
        state = handle.done()
        assert state == "done", f"load ended {state}"
        restored = restore(tm, pools, dev, handle.tokens, case.page)
    finally:
        client.close()
    diff, details = compare(tm, case, restored, handle.tokens)
    return Outcome(
        case,
        hit.tokens_l2,
        hit.tokens_total,
        handle.tokens,
        stored,
        diff,
        details,
    )
