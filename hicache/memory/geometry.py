"""`GroupGeometry`: the byte shape of one cache group's pages.

A token group's page is `page_size_tokens` slots; a state group's page is one request's state
snapshot (one slot). For each layer a page holds one row per tensor (K, V, latent, index K,
conv, ssm, ...); every size here is derived from the layout and the dtype, never configured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hicache.errors import ConfigError
from hicache.model import CacheGroup

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    # fp8 caches are stored and moved as raw bytes; the engine owns their interpretation
    "float8_e4m3fn": torch.uint8,
    "float8_e5m2": torch.uint8,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype {name!r} is not supported; allowed: {sorted(_DTYPES)}") from None


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    group: CacheGroup
    dtype: torch.dtype
    page_size_tokens: int
    # derived once (the scheduler asks for them on every op)
    _tensors: tuple[tuple[str, tuple[int, ...]], ...] = field(init=False, repr=False, compare=False)
    _page_bytes_per_layer: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        spec = self.group.spec
        tensors = spec.token_tensors() if spec.kind.is_token_cache else spec.state_shapes
        object.__setattr__(self, "_tensors", tuple(tensors))
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

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def row_bytes(self, tensor: str) -> int:
        """Bytes of one page of one tensor of one layer."""
        spec = self.group.spec
        tensors = spec.token_tensors() if spec.kind.is_token_cache else spec.state_shapes
        shape = dict(tensors)[tensor]
        return self.slots_per_page * math.prod(shape) * self.itemsize

    @property
    def page_bytes_per_layer(self) -> int:
        return self._page_bytes_per_layer

    @property
    def page_bytes(self) -> int:
        """One page across all of this group's layers (one page_first record)."""
        return self.page_bytes_per_layer * self.num_layers
