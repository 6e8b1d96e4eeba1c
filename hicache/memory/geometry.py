"""`GroupGeometry`: the byte shape of one cache group's pages; `CacheDtypes`: whose dtype is what.

A token group's page is `page_size_tokens` slots; a state group's page is one request's state
snapshot (one slot). For each layer a page holds one row per tensor (K, V, latent, index K,
conv, ssm, ...); every size here is derived from the layout and the dtypes, never configured.
Engines keep hybrid state in dtypes of its own (vLLM's `mamba_cache_dtype` and
`mamba_ssm_cache_dtype`, SGLang's `mamba_ssm_dtype`: often a float32 SSM state beside a bf16 or
fp8 KV cache), so a geometry has a dtype per tensor: `GroupGeometry.of(group, dtypes, page)`
resolves them from a `CacheDtypes`. `group_geometries` is the one place a layout's groups get
their geometries (the embedded stack, the sidecar, its clients, the CLI, the demo, vLLM).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from hicache.errors import ConfigError
from hicache.model import CacheGroup

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    # fp8 caches are moved as raw bytes; engines often keep them in uint8 tensors (SGLang's
    # store dtype, vLLM's "fp8"), which a pool of these dtypes accepts (`accepts_dtype`)
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


_FP8 = ("float8_e4m3fn", "float8_e5m2")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype {name!r} is not supported; allowed: {sorted(_DTYPES)}") from None


CONV_STATE = "conv"  # the state tensor with `state`'s dtype; every other one takes `ssm_state`'s


@dataclass(frozen=True, slots=True)
class CacheDtypes:
    """The dtype of each kind of tensor: KV (with MLA latents and sparse index K/V), the conv
    state, and the SSM state (SSM / recurrent, "temporal" in SGLang: every state tensor but
    `conv`). None: not given, and no default fits (states beside an fp8 KV cache)."""

    kv: torch.dtype
    state: torch.dtype | None
    ssm_state: torch.dtype | None

    @classmethod
    def uniform(cls, dtype: torch.dtype) -> CacheDtypes:
        return cls(dtype, dtype, dtype)

    @classmethod
    def from_names(
        cls, kv: str, state: str | None = None, ssm_state: str | None = None
    ) -> CacheDtypes:
        """From config names. `state` defaults to `kv`, except that an fp8 KV cache gives no
        default (engines keep states in the model's dtype, or float32); `ssm_state` defaults
        to `state`."""
        if state is None and kv not in _FP8:
            state = kv
        state_dtype = None if state is None else torch_dtype(state)
        ssm = state_dtype if ssm_state is None else torch_dtype(ssm_state)
        return cls(torch_dtype(kv), state_dtype, ssm)

    def for_tensor(self, token_cache: bool, tensor: str) -> torch.dtype:
        if token_cache:
            return self.kv
        found = self.state if tensor == CONV_STATE else self.ssm_state
        if found is None:
            setting = "model.state_dtype" if tensor == CONV_STATE else "model.ssm_state_dtype"
            raise ConfigError(
                f"state tensor {tensor!r} has no dtype: model.dtype is fp8, which engines use "
                f"for the KV only; set {setting} to the dtype of the engine's state cache "
                "(vLLM: mamba_cache_dtype / mamba_ssm_cache_dtype, 'auto' = the model's dtype; "
                f"SGLang: the model's dtype / mamba_ssm_dtype); allowed: {sorted(_DTYPES)}"
            )
        return found


def _tensors_of(group: CacheGroup) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape of one slot) of each tensor a layer of the group keeps."""
    spec = group.spec
    return tuple(spec.token_tensors() if spec.kind.is_token_cache else spec.state_shapes)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    group: CacheGroup
    dtype: torch.dtype  # of every tensor not named in `tensor_dtypes`
    page_size_tokens: int
    tensor_dtypes: tuple[tuple[str, torch.dtype], ...] = ()  # per-tensor exceptions
    # derived once (the scheduler asks for them on every op)
    _tensors: tuple[tuple[str, tuple[int, ...]], ...] = field(init=False, repr=False, compare=False)
    _dtypes: dict[str, torch.dtype] = field(init=False, repr=False, compare=False)
    _page_bytes_per_layer: int = field(init=False, repr=False, compare=False)

    @classmethod
    def of(cls, group: CacheGroup, dtypes: CacheDtypes, page_size_tokens: int) -> GroupGeometry:
        """The geometry of a group whose tensors take their dtypes from `dtypes`."""
        token_cache = group.kind.is_token_cache
        own = group.spec.index.dtypes() if group.spec.index is not None else {}
        per_tensor = {
            name: torch_dtype(own[name]) if name in own else dtypes.for_tensor(token_cache, name)
            for name, _ in _tensors_of(group)
        }
        main = (
            dtypes.kv
            if token_cache
            else per_tensor.get(CONV_STATE, next(iter(per_tensor.values())))
        )
        exceptions = tuple((n, d) for n, d in per_tensor.items() if d != main)
        return cls(group, main, page_size_tokens, exceptions)

    def __post_init__(self) -> None:
        tensors = _tensors_of(self.group)
        names = {name for name, _ in tensors}
        unknown = sorted(set(dict(self.tensor_dtypes)) - names)
        if unknown:
            raise ConfigError(
                f"group {self.group.name!r}: dtypes given for tensors {unknown} it does not "
                f"have; its tensors are {sorted(names)}"
            )
        object.__setattr__(self, "_tensors", tuple(tensors))
        object.__setattr__(
            self, "_dtypes", {name: self.dtype for name in names} | dict(self.tensor_dtypes)
        )
        object.__setattr__(
            self, "_page_bytes_per_layer", sum(self.row_bytes(name) for name, _ in tensors)
        )

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def num_layers(self) -> int:
        return len(self.group.layer_ids)

    @property
    def slots_per_page(self) -> int:
        return self.page_size_tokens if self.group.kind.is_token_cache else 1

    @property
    def tensors(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(name, shape of one slot) for every tensor a layer of this group keeps."""
        return self._tensors

    def dtype_of(self, tensor: str) -> torch.dtype:
        return self._dtypes[tensor]

    def accepts_dtype(self, tensor: str, given: torch.dtype) -> bool:
        """An engine tensor of `given` dtype can be this tensor: the same dtype, or uint8
        holding an fp8 cache's bytes."""
        want = self._dtypes[tensor]
        return given == want or (want in _FP8_DTYPES and given == torch.uint8)

    @property
    def dtype_signature(self) -> str:
        """The dtypes as one string ("bfloat16", or "bfloat16 ssm=float32"): part of every
        page key's namespace, and of the layout an engine and the sidecar compare."""
        exceptions = " ".join(f"{n}={dtype_name(d)}" for n, d in sorted(self.tensor_dtypes))
        return f"{dtype_name(self.dtype)} {exceptions}".strip()

    def row_bytes(self, tensor: str) -> int:
        """Bytes of one page of one tensor of one layer."""
        shape = dict(self._tensors)[tensor]
        return self.slots_per_page * math.prod(shape) * self._dtypes[tensor].itemsize

    @property
    def page_bytes_per_layer(self) -> int:
        return self._page_bytes_per_layer

    @property
    def page_bytes(self) -> int:
        """One page across all of this group's layers (one page_first record)."""
        return self.page_bytes_per_layer * self.num_layers


def group_geometries(
    groups: Iterable[CacheGroup], dtypes: CacheDtypes, page_size_tokens: int
) -> dict[str, GroupGeometry]:
    """Each group's geometry by name, in the layout's order: the one way a stack, the sidecar,
    a client, the CLI and the demo size a group's pages."""
    return {g.name: GroupGeometry.of(g, dtypes, page_size_tokens) for g in groups}
