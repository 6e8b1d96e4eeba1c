"""Helpers the family rules share: a checked view of a config dict and cache-spec builders.

`ConfigView` reads fields with the family's documented defaults and raises a `LayoutError`
naming the field, the value and what is allowed. The builders turn config fields into
`CacheSpec`s for attention, MLA, Mamba-1/2, gated-delta-net, lightning, KDA and short conv.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from hicache.errors import LayoutError
from hicache.model.specs import CacheKind, CacheSpec, IndexSpec, KvFormat, LayerSpec


class ConfigView:
    """A decoder config dict plus the family's defaults, with checked typed getters."""

    def __init__(
        self,
        data: Mapping[str, Any],
        model_type: str,
        source: str,
        defaults: Mapping[str, Any] | None = None,
    ):
        self.data = data
        self.model_type = model_type
        self.source = source
        self.defaults = dict(defaults or {})

    def with_defaults(self, defaults: Mapping[str, Any]) -> ConfigView:
        return ConfigView(self.data, self.model_type, self.source, {**defaults, **self.defaults})

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
        return self.req_int("num_hidden_layers")

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

    def layer_types(self) -> list[str] | None:
        """The config's `layer_types`, checked to have one entry per layer."""
        types = self.str_list("layer_types")
        if types is not None:
            self.per_layer("layer_types", self.num_layers, types)
        return types


# ---- cache-spec builders ------------------------------------------------------------------


def attention(
    cfg: ConfigView,
    kind: CacheKind,
    *,
    window: int | None = None,
    chunk: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    k_is_v: bool = False,
) -> CacheSpec:
    dim = head_dim if head_dim is not None else cfg.head_dim
    return CacheSpec(
        kind=kind,
        kv_format=KvFormat.MHA,
        num_kv_heads=kv_heads if kv_heads is not None else cfg.kv_heads,
        head_dim=dim,
        v_head_dim=None if k_is_v else dim,
        window_tokens=window,
        chunk_tokens=chunk,
    )


def full(cfg: ConfigView) -> CacheSpec:
    return attention(cfg, CacheKind.FULL)


def sliding(cfg: ConfigView, window_key: str = "sliding_window") -> CacheSpec:
    return attention(cfg, CacheKind.SLIDING, window=cfg.req_int(window_key))


def mla(
    cfg: ConfigView, kind: CacheKind = CacheKind.FULL, index: IndexSpec | None = None
) -> CacheSpec:
    latent = cfg.req_int("kv_lora_rank") + cfg.req_int("qk_rope_head_dim", minimum=0)
    return CacheSpec(
        kind=kind, kv_format=KvFormat.MLA, num_kv_heads=1, head_dim=latent, index=index
    )


def state(kind: CacheKind, *shapes: tuple[str, tuple[int, ...]]) -> CacheSpec:
    return CacheSpec(kind=kind, state_shapes=tuple(shapes))


def mamba1(d_inner: int, d_conv: int, d_state: int) -> CacheSpec:
    return state(CacheKind.MAMBA, ("conv", (d_inner, d_conv - 1)), ("ssm", (d_inner, d_state)))


def mamba2(
    *, d_inner: int, n_groups: int, d_state: int, n_heads: int, head_dim: int, d_conv: int
) -> CacheSpec:
    conv_dim = d_inner + 2 * n_groups * d_state
    return state(
        CacheKind.MAMBA, ("conv", (conv_dim, d_conv - 1)), ("ssm", (n_heads, head_dim, d_state))
    )


def gated_delta_net(cfg: ConfigView) -> CacheSpec:
    """Qwen3-Next / Qwen3.5 linear attention: a causal conv over q,k,v plus a delta-rule state."""
    k_heads, v_heads = cfg.req_int("linear_num_key_heads"), cfg.req_int("linear_num_value_heads")
    k_dim, v_dim = cfg.req_int("linear_key_head_dim"), cfg.req_int("linear_value_head_dim")
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    return state(
        CacheKind.LINEAR,
        ("conv", (conv_dim, cfg.req_int("linear_conv_kernel_dim") - 1)),
        ("recurrent", (v_heads, k_dim, v_dim)),
    )


def layers_from_types(
    cfg: ConfigView,
    types: Sequence[str],
    specs: Mapping[str, Callable[[], tuple[CacheSpec, ...]]],
    key: str = "layer_types",
) -> list[LayerSpec]:
    """One LayerSpec per entry of `types`; an unknown name is an error listing the allowed."""
    built: dict[str, tuple[CacheSpec, ...]] = {}
    layers = []
    for layer_id, name in enumerate(types):
        if name not in specs:
            raise cfg.error(
                f"{key}[{layer_id}] is {name!r}; allowed for this family: {sorted(specs)}"
            )
        if name not in built:
            built[name] = specs[name]()
        layers.append(LayerSpec(layer_id, built[name]))
    return layers


T = TypeVar("T")


def every_nth(num_layers: int, n: int, hit: T, miss: T) -> list[T]:
    """`hit` on layers where (i + 1) % n == 0, `miss` elsewhere (the HF pattern rule)."""
    if n <= 0:
        return [miss] * num_layers
    return [hit if (i + 1) % n == 0 else miss for i in range(num_layers)]
