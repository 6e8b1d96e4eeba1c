"""Typed records of what each layer caches: `CacheKind`, `CacheSpec`, `LayerSpec`.

Built once by a family rule (hf_config / explicit) and never mutated. A `CacheSpec` is the
geometry of one cache a layer owns; layers with equal specs share a cache group. Token caches
(full / sliding / chunked / sparse) hold per-token tensors; state caches (linear / mamba /
conv) hold one fixed-size snapshot per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class CacheKind(StrEnum):
    FULL = "full"
    SLIDING = "sliding"
    CHUNKED = "chunked"
    SPARSE = "sparse"
    LINEAR = "linear"
    MAMBA = "mamba"
    CONV = "conv"

    @property
    def is_token_cache(self) -> bool:
        """True for caches that grow with the sequence (paged by tokens)."""
        return self in _TOKEN_KINDS

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self]


_TOKEN_KINDS = frozenset({CacheKind.FULL, CacheKind.SLIDING, CacheKind.CHUNKED, CacheKind.SPARSE})
_DESCRIPTIONS = {
    CacheKind.FULL: "full-attention",
    CacheKind.SLIDING: "sliding-window",
    CacheKind.CHUNKED: "chunked-attention",
    CacheKind.SPARSE: "sparse-attention",
    CacheKind.LINEAR: "linear-attention",
    CacheKind.MAMBA: "mamba",
    CacheKind.CONV: "short-conv",
}


INDEX_SCALE = "index_k_scale"  # an fp8 index's per-block float32 scales (`IndexSpec.fp8_block`)


class KvFormat(StrEnum):
    MHA = "mha"  # separate K and V per KV head
    MLA = "mla"  # one compressed latent per token (kv_lora_rank + rope dims)


@dataclass(frozen=True, slots=True)
class IndexSpec:
    """The side cache a sparse-attention layer keeps for its top-k indexer."""

    head_dim: int
    has_v: bool = False  # index K only (DeepSeek-V3.2 style) or index K+V
    # keys kept as float8_e4m3fn with one float32 scale per `fp8_block` dims, whatever the
    # KV's dtype (DeepSeek Sparse Attention's indexer: 128, in the model's own code, SGLang's
    # DSA pool and vLLM's indexer cache alike); None: index K (and V) in the KV's dtype
    fp8_block: int | None = None

    def __post_init__(self) -> None:
        if self.fp8_block is not None and (
            self.has_v or self.fp8_block < 1 or self.head_dim % self.fp8_block
        ):
            raise ValueError(
                f"index fp8_block {self.fp8_block} with index head_dim {self.head_dim}"
                f"{' and index V' if self.has_v else ''}: an fp8 index is keys only, in blocks "
                "that divide its head_dim"
            )

    def __repr__(self) -> str:
        # page keys hash a spec's repr: an index in the KV's dtype keys as before fp8_block
        extra = "" if self.fp8_block is None else f", fp8_block={self.fp8_block}"
        return f"IndexSpec(head_dim={self.head_dim}, has_v={self.has_v}{extra})"

    def tensors(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The index's per-token tensors, as (name, shape of one token)."""
        if self.fp8_block is not None:
            return (
                ("index_k", (1, self.head_dim)),
                (INDEX_SCALE, (1, self.head_dim // self.fp8_block)),
            )
        out: tuple[tuple[str, tuple[int, ...]], ...] = (("index_k", (1, self.head_dim)),)
        return out + ((("index_v", (1, self.head_dim)),) if self.has_v else ())

    def dtypes(self) -> dict[str, str]:
        """The index tensors whose dtype is their own, not the KV's."""
        if self.fp8_block is None:
            return {}
        return {"index_k": "float8_e4m3fn", INDEX_SCALE: "float32"}


@dataclass(frozen=True, slots=True)
class StateShard:
    """How a state cache splits across tensor-parallel ranks, as the engines split it: the
    rule's name (`model.tensor_parallel` applies it) and the global sizes it needs, e.g.
    ("mamba2", (("d_inner", 8192), ("n_groups", 8), ...)). Set by the family builder that
    knows the sizes; a state cache without one is refused at tp_size > 1."""

    rule: str
    sizes: tuple[tuple[str, int], ...]

    def size(self, name: str) -> int:
        return dict(self.sizes)[name]


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """One cache's kind and geometry. Equal specs share a group (and a pool)."""

    kind: CacheKind
    kv_format: KvFormat | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None  # K head dim; the latent width for MLA
    v_head_dim: int | None = None  # None: no separate V (MLA latent, or K doubles as V)
    window_tokens: int | None = None
    chunk_tokens: int | None = None
    index: IndexSpec | None = None
    # state caches: named tensor shapes of one request's snapshot, e.g. ("ssm", (128, 64, 128))
    state_shapes: tuple[tuple[str, tuple[int, ...]], ...] = field(default=())
    # a state cache's tensor-parallel split (None: unknown, refused at tp_size > 1); left out
    # of repr (page keys hash it) and of equality (groups are geometry), so nothing at
    # tp_size 1 changes with it
    shard: StateShard | None = field(default=None, repr=False, compare=False)

    @property
    def replicated_across_ranks(self) -> bool:
        """True when every tensor-parallel rank holds the same bytes: an MLA latent (and a
        sparse layer's indexer keys beside it) is computed whole on every rank. Such a cache
        is stored once in L3 and served to every rank."""
        return self.kv_format is KvFormat.MLA

    def token_tensors(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Per-token tensors of a token cache, as (name, shape of one token)."""
        if not self.kind.is_token_cache:
            return ()
        assert self.num_kv_heads is not None
        assert self.head_dim is not None
        if self.kv_format is KvFormat.MLA:
            out: list[tuple[str, tuple[int, ...]]] = [("kv", (1, self.head_dim))]
        else:
            out = [("k", (self.num_kv_heads, self.head_dim))]
            if self.v_head_dim is not None:
                out.append(("v", (self.num_kv_heads, self.v_head_dim)))
        if self.index is not None:
            out.extend(self.index.tensors())
        return tuple(out)

    def describe(self) -> str:
        """Human words for error messages: 'sliding-window layer (window 1024)'."""
        extra = ""
        if self.window_tokens is not None:
            extra = f" (window {self.window_tokens})"
        elif self.chunk_tokens is not None:
            extra = f" (chunk {self.chunk_tokens})"
        elif self.kv_format is KvFormat.MLA:
            extra = " (MLA)"
        return f"{self.kind.description} layer{extra}"

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"kind": self.kind.value}
        if self.kind.is_token_cache:
            out |= {
                "kv_format": self.kv_format.value if self.kv_format else None,
                "kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim,
                "v_head_dim": self.v_head_dim,
            }
        if self.window_tokens is not None:
            out["window_tokens"] = self.window_tokens
        if self.chunk_tokens is not None:
            out["chunk_tokens"] = self.chunk_tokens
        if self.index is not None:
            index: dict[str, object] = {"head_dim": self.index.head_dim, "has_v": self.index.has_v}
            if self.index.fp8_block is not None:
                index["fp8_block"] = self.index.fp8_block
            out["index"] = index
        if self.state_shapes:
            out["state_shapes"] = {name: list(shape) for name, shape in self.state_shapes}
        return out


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One decoder layer: the caches it owns (0, 1 or 2), or the layer whose KV it reads."""

    layer_id: int
    caches: tuple[CacheSpec, ...] = ()
    reuses: int | None = None

    @property
    def kinds(self) -> tuple[CacheKind, ...]:
        return tuple(sorted((c.kind for c in self.caches), key=lambda k: k.value))

    def describe(self) -> str:
        if self.reuses is not None:
            return f"a KV-sharing layer that reads layer {self.reuses}'s cache"
        if not self.caches:
            return "a layer with no cache (MLP/MoE only)"
        parts = [c.describe() for c in self.caches]
        article = "an" if parts[0][0] in "aeiou" else "a"
        return f"{article} " + " plus ".join(parts)
