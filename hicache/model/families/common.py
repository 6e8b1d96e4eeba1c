"""Helpers the family rules share: a checked view of a config dict and cache-spec builders.

Lifecycle: `hf_config` wraps the decoder dict in a `ConfigView`; a family rule adds its
documented defaults (`with_defaults`), reads fields through the checked getters (a bad field
raises a `LayoutError` naming the field, the value and what is allowed), and turns each layer
into `CacheSpec`s with the builders below, reading per-layer fields from `cfg.layer(i)`.

Configs come in two spellings and both are read: the hub's (`num_hidden_layers` plus a
pattern field) and the one transformers 5.x writes when it re-saves a config (a
`layer_types` / `layers_block_type` list whose length is the layer count, legacy names such
as 'mamba' / 'attention' replaced by 'linear_attention' / 'full_attention', and
`per_layer_config`: sparse per-layer overrides such as `{"05": {"head_dim": 512}}`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from hicache.errors import LayoutError
from hicache.model.specs import CacheKind, CacheSpec, IndexSpec, KvFormat, LayerSpec, StateShard

# Lists that name one entry per layer; the first present one gives the layer count when
# `num_hidden_layers` is missing (transformers 5.x derives the count from them).
LAYER_LIST_KEYS = ("layer_types", "layers_block_type")

# What `per_layer_config` may override: attention geometry. Anything else (MLP sizes, rope)
# does not change a cache; `skip` (a sub-layer left out) is refused rather than guessed.
_LAYER_FIELDS = frozenset(
    {
        "head_dim",
        "v_head_dim",
        "num_key_value_heads",
        "num_attention_heads",
        "sliding_window",
        "attention_chunk_size",
    }
)


class ConfigView:
    """A decoder config dict plus the family's defaults, with checked typed getters."""

    def __init__(
        self,
        data: Mapping[str, Any],
        model_type: str,
        source: str,
        defaults: Mapping[str, Any] | None = None,
        overrides: Mapping[int, Mapping[str, Any]] | None = None,
    ):
        self.data = data
        self.model_type = model_type
        self.source = source
        self.defaults = dict(defaults or {})
        self._overrides = overrides
        self._parsed: dict[int, dict[str, Any]] | None = None

    def with_defaults(self, defaults: Mapping[str, Any]) -> ConfigView:
        return ConfigView(
            self.data, self.model_type, self.source, {**defaults, **self.defaults}, self._overrides
        )

    def with_layer_overrides(self, overrides: Mapping[int, Mapping[str, Any]]) -> ConfigView:
        """The same config with per-layer fields set by a rule (e.g. Gemma 4's global heads)."""
        return ConfigView(self.data, self.model_type, self.source, self.defaults, overrides)

    def error(self, message: str) -> LayoutError:
        where = f" ({self.source})" if self.source else ""
        return LayoutError(f"{self.model_type} config{where}: {message}")

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.data:
            return self.data[key]
        return self.defaults.get(key, default)

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def req_int(self, key: str, *, minimum: int = 1) -> int:
        value = self.get(key)
        if value is None:
            raise self.error(f"field {key!r} is missing; an integer >= {minimum} is required")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(f"field {key!r} is {value!r}; allowed: an integer >= {minimum}")
        return value

    def opt_int(self, key: str, *, minimum: int = 1) -> int | None:
        if self.get(key) is None:
            return None
        return self.req_int(key, minimum=minimum)

    def int_list(self, key: str) -> list[int] | None:
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise self.error(f"field {key!r} is {value!r}; allowed: a list of integers")
        return value

    def str_list(self, key: str) -> list[str] | None:
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(f"field {key!r} is {value!r}; allowed: a list of strings")
        return value

    @property
    def num_layers(self) -> int:
        """`num_hidden_layers`, or the length of the config's per-layer list."""
        if self.get("num_hidden_layers") is not None:
            return self.req_int("num_hidden_layers")
        for key in LAYER_LIST_KEYS:
            value = self.str_list(key)
            if value:
                return len(value)
        raise self.error(
            "field 'num_hidden_layers' is missing and no per-layer list "
            f"({' or '.join(repr(k) for k in LAYER_LIST_KEYS)}) gives the count; "
            "an integer >= 1 is required"
        )

    @property
    def num_heads(self) -> int:
        return self.req_int("num_attention_heads")

    @property
    def kv_heads(self) -> int:
        if self.get("num_key_value_heads") is None:
            return self.num_heads
        return self.req_int("num_key_value_heads")

    @property
    def head_dim(self) -> int:
        if self.get("head_dim") is None:
            return self.req_int("hidden_size") // self.num_heads
        return self.req_int("head_dim")

    def per_layer(self, key: str, length: int, values: Sequence[Any]) -> None:
        if len(values) != length:
            raise self.error(
                f"field {key!r} has {len(values)} entries; it must have one per layer "
                f"(num_hidden_layers = {length})"
            )

    def layer_types(self, key: str = "layer_types") -> list[str] | None:
        """The config's per-layer type list, checked to have one entry per layer."""
        types = self.str_list(key)
        if types is not None:
            self.per_layer(key, self.num_layers, types)
        return types

    # ---- per-layer overrides ---------------------------------------------------------------

    def layer(self, layer_id: int) -> ConfigView:
        """The view layer `layer_id`'s attention reads: the config with that layer's
        `per_layer_config` entry (and any rule-set overrides) laid over it."""
        extra = self.layer_overrides().get(layer_id)
        if not extra:
            return self
        return ConfigView({**self.data, **extra}, self.model_type, self.source, self.defaults)

    def layer_overrides(self) -> dict[int, dict[str, Any]]:
        """Layer index -> overridden fields, from the rule or from `per_layer_config`."""
        if self._parsed is None:
            self._parsed = self._read_overrides()
        return self._parsed

    def _read_overrides(self) -> dict[int, dict[str, Any]]:
        if self._overrides is not None:
            return {i: dict(v) for i, v in self._overrides.items()}
        raw = self.data.get("per_layer_config")
        if raw is None:
            return {}
        if not isinstance(raw, Mapping):
            raise self.error(
                f"field 'per_layer_config' is {raw!r}; allowed: a mapping from layer index "
                'to field overrides, e.g. {"05": {"head_dim": 512}}'
            )
        n = self.num_layers
        out: dict[int, dict[str, Any]] = {}
        for key, fields in raw.items():
            index = _layer_index(key)
            if index is None or not 0 <= index < n:
                raise self.error(
                    f"per_layer_config key {key!r} is not a layer index; allowed: 0..{n - 1}"
                )
            if not isinstance(fields, Mapping):
                raise self.error(f"per_layer_config[{key!r}] is {fields!r}; a mapping is required")
            if fields.get("skip"):
                raise self.error(
                    f"per_layer_config[{key!r}] skips {fields['skip']!r}; a layer that leaves out "
                    "sub-layers is not supported, give an explicit layer list instead"
                )
            out[index] = {k: v for k, v in fields.items() if k in _LAYER_FIELDS}
        return out


def _layer_index(key: object) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isdigit():
        return int(key)
    return None


# ---- cache-spec builders ------------------------------------------------------------------


def attention(
    cfg: ConfigView,
    kind: CacheKind,
    *,
    window: int | None = None,
    chunk: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    v_head_dim: int | None = None,
) -> CacheSpec:
    """An MHA/GQA token cache: K of `head_dim` and V of `v_head_dim` (default: `head_dim`)
    per KV head."""
    dim = head_dim if head_dim is not None else cfg.head_dim
    return CacheSpec(
        kind=kind,
        kv_format=KvFormat.MHA,
        num_kv_heads=kv_heads if kv_heads is not None else cfg.kv_heads,
        head_dim=dim,
        v_head_dim=v_head_dim if v_head_dim is not None else dim,
        window_tokens=window,
        chunk_tokens=chunk,
    )


def full(cfg: ConfigView) -> CacheSpec:
    return attention(cfg, CacheKind.FULL)


def sliding(cfg: ConfigView, window_key: str = "sliding_window") -> CacheSpec:
    return attention(cfg, CacheKind.SLIDING, window=cfg.req_int(window_key))


def chunked(cfg: ConfigView) -> CacheSpec:
    return attention(cfg, CacheKind.CHUNKED, chunk=cfg.req_int("attention_chunk_size"))


def mla(
    cfg: ConfigView, kind: CacheKind = CacheKind.FULL, index: IndexSpec | None = None
) -> CacheSpec:
    latent = cfg.req_int("kv_lora_rank") + cfg.req_int("qk_rope_head_dim", minimum=0)
    return CacheSpec(
        kind=kind, kv_format=KvFormat.MLA, num_kv_heads=1, head_dim=latent, index=index
    )


def state(
    kind: CacheKind, *shapes: tuple[str, tuple[int, ...]], shard: StateShard | None = None
) -> CacheSpec:
    """A state cache; `shard` says how tensor parallelism splits it (None: refused at
    tp_size > 1, see `model.tensor_parallel`)."""
    return CacheSpec(kind=kind, state_shapes=tuple(shapes), shard=shard)


# State geometry follows the serving engines (vLLM, SGLang), whose pools hicache copies: a
# causal conv keeps the last `kernel - 1` inputs per channel. (transformers' own cache keeps
# `kernel` columns; the extra one is never read back.)


def mamba1(d_inner: int, d_conv: int, d_state: int) -> CacheSpec:
    return state(
        CacheKind.MAMBA,
        ("conv", (d_inner, d_conv - 1)),
        ("ssm", (d_inner, d_state)),
        shard=StateShard("mamba1", (("d_inner", d_inner),)),
    )


def mamba2(
    *, d_inner: int, n_groups: int, d_state: int, n_heads: int, head_dim: int, d_conv: int
) -> CacheSpec:
    conv_dim = d_inner + 2 * n_groups * d_state
    sizes = (("d_inner", d_inner), ("n_groups", n_groups), ("d_state", d_state))
    return state(
        CacheKind.MAMBA,
        ("conv", (conv_dim, d_conv - 1)),
        ("ssm", (n_heads, head_dim, d_state)),
        shard=StateShard("mamba2", (*sizes, ("n_heads", n_heads))),
    )


def gated_delta_net(cfg: ConfigView) -> CacheSpec:
    """Qwen3-Next / Qwen3.5 / OLMo-Hybrid linear attention: a causal conv over q, k, v plus a
    delta-rule state per value head, (k_dim x v_dim) as SGLang keeps it."""
    k_heads, v_heads = cfg.req_int("linear_num_key_heads"), cfg.req_int("linear_num_value_heads")
    k_dim, v_dim = cfg.req_int("linear_key_head_dim"), cfg.req_int("linear_value_head_dim")
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    return state(
        CacheKind.LINEAR,
        ("conv", (conv_dim, cfg.req_int("linear_conv_kernel_dim") - 1)),
        ("recurrent", (v_heads, k_dim, v_dim)),
        shard=StateShard(
            "gated_delta_net",
            (("k_heads", k_heads), ("v_heads", v_heads), ("k_dim", k_dim), ("v_dim", v_dim)),
        ),
    )


Builder = Callable[[ConfigView], tuple[CacheSpec, ...]]


def layers_from_types(
    cfg: ConfigView,
    types: Sequence[str],
    specs: Mapping[str, Builder],
    key: str = "layer_types",
) -> list[LayerSpec]:
    """One LayerSpec per entry of `types`, each built from that layer's view (its
    `per_layer_config` applied); an unknown name is an error listing the allowed ones."""
    layers = []
    for layer_id, name in enumerate(types):
        if name not in specs:
            raise cfg.error(
                f"{key}[{layer_id}] is {name!r}; allowed for this family: {sorted(specs)}"
            )
        layers.append(LayerSpec(layer_id, specs[name](cfg.layer(layer_id))))
    return layers


T = TypeVar("T")


def every_nth(num_layers: int, n: int, hit: T, miss: T) -> list[T]:
    """`hit` on layers where (i + 1) % n == 0, `miss` elsewhere (the HF pattern rule)."""
    if n <= 0:
        return [miss] * num_layers
    return [hit if (i + 1) % n == 0 else miss for i in range(num_layers)]
