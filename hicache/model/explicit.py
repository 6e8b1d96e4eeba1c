"""Explicit layer lists: a layout written by hand in YAML, for models no family rule knows.

    model_type: my-model
    layers:
      - {repeat: 5, kind: sliding, kv_heads: 8, head_dim: 128, window_tokens: 1024}
      - {kind: full, kv_heads: 8, head_dim: 128}
      - caches:                                  # a layer with two caches
          - {kind: full, kv_heads: 2, head_dim: 128}
          - {kind: mamba, state_shapes: {conv: [8192, 3], ssm: [128, 64, 128]}}
      - {kind: none}                             # MLP/MoE only
      - {reuses: 3}                              # reads layer 3's KV

Entries are validated by pydantic (unknown keys rejected) and expanded by `repeat`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hicache.model.layout import ModelLayout
from hicache.model.specs import CacheKind, CacheSpec, IndexSpec, KvFormat, LayerSpec


class CacheEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: CacheKind
    kv_format: KvFormat = KvFormat.MHA
    kv_heads: int | None = Field(default=None, ge=1)
    head_dim: int | None = Field(default=None, ge=1, description="K head dim; MLA latent width")
    v_head_dim: int | Literal["none"] | None = Field(
        default=None, description="V head dim (default: head_dim); 'none' when K doubles as V"
    )
    window_tokens: int | None = Field(default=None, ge=1)
    chunk_tokens: int | None = Field(default=None, ge=1)
    index_head_dim: int | None = Field(default=None, ge=1)
    index_has_v: bool = False
    index_fp8_block: int | None = Field(
        default=None,
        ge=1,
        description="index keys in float8_e4m3fn with one float32 scale per this many dims "
        "(DeepSeek Sparse Attention: 128); unset: in the KV dtype",
    )
    state_shapes: dict[str, list[int]] | None = None

    @model_validator(mode="after")
    def _check(self) -> CacheEntry:
        kind = self.kind
        if kind.is_token_cache:
            if self.head_dim is None or (self.kv_format is KvFormat.MHA and self.kv_heads is None):
                raise ValueError(f"a {kind.value} cache needs kv_heads and head_dim")
            if self.state_shapes:
                raise ValueError(f"a {kind.value} cache has no state_shapes")
        elif not self.state_shapes:
            raise ValueError(f"a {kind.value} cache needs state_shapes, e.g. {{ssm: [16, 64]}}")
        if (kind is CacheKind.SLIDING) != (self.window_tokens is not None):
            raise ValueError("window_tokens is required for, and only for, kind sliding")
        if (kind is CacheKind.CHUNKED) != (self.chunk_tokens is not None):
            raise ValueError("chunk_tokens is required for, and only for, kind chunked")
        if self.index_head_dim is not None and kind is not CacheKind.SPARSE:
            raise ValueError("index_head_dim is only for kind sparse")
        if self.index_fp8_block is not None and self.index_head_dim is None:
            raise ValueError("index_fp8_block needs index_head_dim")
        if self.index_head_dim is not None:
            IndexSpec(self.index_head_dim, self.index_has_v, self.index_fp8_block)  # its checks
        for name, shape in (self.state_shapes or {}).items():
            if not shape or any(d < 1 for d in shape):
                raise ValueError(f"state_shapes.{name} is {shape}; dims must be >= 1")
        return self

    def to_spec(self) -> CacheSpec:
        if not self.kind.is_token_cache:
            shapes = tuple((k, tuple(v)) for k, v in (self.state_shapes or {}).items())
            return CacheSpec(kind=self.kind, state_shapes=shapes)
        mla = self.kv_format is KvFormat.MLA
        v_dim = None if mla or self.v_head_dim == "none" else (self.v_head_dim or self.head_dim)
        assert not isinstance(v_dim, str)
        index = None
        if self.index_head_dim is not None:
            index = IndexSpec(self.index_head_dim, self.index_has_v, self.index_fp8_block)
        return CacheSpec(
            kind=self.kind,
            kv_format=self.kv_format,
            num_kv_heads=1 if mla else self.kv_heads,
            head_dim=self.head_dim,
            v_head_dim=v_dim,
            window_tokens=self.window_tokens,
            chunk_tokens=self.chunk_tokens,
            index=index,
        )


_CACHE_FIELDS = set(CacheEntry.model_fields)


class LayerEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    repeat: int = Field(default=1, ge=1)
    caches: list[CacheEntry] = Field(default_factory=list)
    reuses: int | None = Field(default=None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _inline(cls, data: Any) -> Any:
        """`{kind: full, ...}` is shorthand for `{caches: [{kind: full, ...}]}`;
        `{kind: none}` is a layer with no cache."""
        if not isinstance(data, dict) or "kind" not in data:
            return data
        if "caches" in data:
            raise ValueError("give either 'kind' (one cache inline) or 'caches', not both")
        rest = {k: v for k, v in data.items() if k not in _CACHE_FIELDS}
        inline = {k: v for k, v in data.items() if k in _CACHE_FIELDS}
        if inline.get("kind") == "none":
            if len(inline) > 1:
                raise ValueError("a layer of kind none takes no cache fields")
            return {**rest, "caches": []}
        return {**rest, "caches": [inline]}


class ExplicitLayout(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_type: str = "explicit"
    layers: list[LayerEntry] = Field(min_length=1)

    def to_layout(self, source: str = "") -> ModelLayout:
        specs: list[LayerSpec] = []
        for entry in self.layers:
            caches = tuple(c.to_spec() for c in entry.caches)
            for _ in range(entry.repeat):
                specs.append(LayerSpec(len(specs), caches, entry.reuses))
        return ModelLayout.build(self.model_type, specs, source, rule="explicit layer list")
