"""Page keys: a chained hash over each full page's token ids, seeded by the previous page's
key; the first page is seeded by the namespace (the model's identity and architecture, dtype,
KV layout, page size, tensor / pipeline rank, cache group and an optional tenant salt), so two
namespaces never share a key: an fp8 cache is never read as bf16, two fine-tunes of one
architecture never read each other's KV, and tenants never read each other's pages.

Keys are 16-byte digests. Algorithms: xxh3_128 (the default; fast), blake2b and sha256.
Partial trailing pages get no key.
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import xxhash

from hicache.errors import ConfigError

HashAlgorithm = Literal["sha256", "blake2b", "xxh3_128"]
PageKey = bytes
KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class Namespace:
    model: str  # the weights' identity (`model.name`): fine-tunes of one architecture differ
    dtype: str
    kv_layout: str  # the group's geometry, e.g. "full:mha:8x128"
    page_size_tokens: int
    group: str
    tp_rank: int = 0
    pp_rank: int = 0
    tenant_salt: str = ""
    model_type: str = ""  # the architecture, beside the identity

    def seed(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()


def _hasher(algorithm: str) -> Callable[[bytes], bytes]:
    if algorithm == "sha256":
        return lambda data: hashlib.sha256(data).digest()[:KEY_BYTES]
    if algorithm == "blake2b":
        return lambda data: hashlib.blake2b(data, digest_size=KEY_BYTES).digest()
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128_digest
    raise ConfigError(
        f"page key algorithm {algorithm!r} is not supported; allowed: sha256, blake2b, xxh3_128"
    )


class PageKeyer:
    def __init__(self, namespace: Namespace, algorithm: str = "xxh3_128"):
        self.namespace = namespace
        self.algorithm = algorithm
        self._hash = _hasher(algorithm)
        self._root = self._hash(b"hicache-page-key-v1\0" + namespace.seed())

    def keys(self, token_ids: Sequence[int]) -> list[PageKey]:
        """One key per full page of `token_ids`, each chained on the one before."""
        size = self.namespace.page_size_tokens
        full = len(token_ids) // size * size
        try:
            words = array.array("I", token_ids[:full])  # uint32, as the wire carries them
        except OverflowError:
            raise ConfigError(
                f"token ids must be in 0..{2**32 - 1} (got one outside among {full} tokens)"
            ) from None
        if sys.byteorder == "big":
            words.byteswap()  # keys are defined over little-endian token bytes
        data = words.tobytes()
        step = 4 * size
        out: list[PageKey] = []
        previous = self._root
        hash_ = self._hash
        for start in range(0, len(data), step):
            previous = hash_(previous + data[start : start + step])
            out.append(previous)
        return out
