"""Page keys: a chained hash over each full page's token ids, seeded by the previous page's
key; the first page is seeded by the namespace (the model's identity and architecture, dtype,
KV layout, page size, tensor rank and size, pipeline rank, cache group and an optional tenant
salt), so two
namespaces never share a key: an fp8 cache is never read as bf16, two fine-tunes of one
architecture never read each other's KV, and tenants never read each other's pages. A group
replicated across tensor-parallel ranks (an MLA latent) is keyed as rank 0 on every rank, so
all ranks of one size share its pages; the size stays in (another size reduces in another
order, so its bytes may differ in the last bits) and is left out of the seed when 1, so keys
from before it existed stay valid.

Keys are 16-byte digests. Algorithms: xxh3_128 (the default; fast), blake2b and sha256.
Partial trailing pages get no key.

A keyer is its algorithm, page size and *root* (the digest of the namespace's seed, which the
first page chains on): `PageKeyer.from_root` rebuilds one from those three alone, which is how
an engine computes the very keys the sidecar's index holds (the sidecar's `hello` reply carries
each group's root; the root reveals nothing of the seed — tenant salt, model — it hashes).
`PackedKeys` is a group's keys as one blob of concatenated 16-byte keys (what the engine
channel carries): slicing it unpacks a run of keys at C speed (`struct`), and indexing one key
slices only that key, so a lookup touches only the keys it needs.
"""

from __future__ import annotations

import array
import hashlib
import json
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Literal, overload

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
    # the tensor-parallel size: with kv_heads < tp_size, rank 1 of 4 and rank 1 of 2 hold
    # different heads of one shape
    tp_size: int = 1

    def seed(self) -> bytes:
        fields = asdict(self)
        if fields["tp_size"] == 1:
            del fields["tp_size"]  # the seed (and every key) as before tp_size existed
        return json.dumps(fields, sort_keys=True).encode()


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
        self.namespace: Namespace | None = namespace
        self.algorithm = algorithm
        self.page_size_tokens = namespace.page_size_tokens
        self._hash = _hasher(algorithm)
        self.root: bytes = self._hash(b"hicache-page-key-v1\0" + namespace.seed())

    @classmethod
    def from_root(cls, root: bytes, page_size_tokens: int, algorithm: str) -> PageKeyer:
        """The keyer whose first page chains on `root` (`PageKeyer.root` of the namespace's
        keyer): its keys are that keyer's, without knowing the namespace's seed."""
        if len(root) != KEY_BYTES:
            raise ConfigError(f"a keyer's root is {KEY_BYTES} bytes (got {len(root)})")
        if page_size_tokens < 1:
            raise ConfigError(f"page_size_tokens is {page_size_tokens}; it must be >= 1")
        keyer = cls.__new__(cls)
        keyer.namespace = None
        keyer.algorithm = algorithm
        keyer.page_size_tokens = page_size_tokens
        keyer._hash = _hasher(algorithm)
        keyer.root = bytes(root)
        return keyer

    def keys(self, token_ids: Sequence[int]) -> list[PageKey]:
        """One key per full page of `token_ids`, each chained on the one before."""
        return self.keys_of_bytes(self.token_bytes(token_ids))

    def token_bytes(self, token_ids: Sequence[int]) -> bytes:
        """The full pages' token ids as little-endian uint32: what keys are computed over
        (convert once, key every group from it: `keys_of_bytes`)."""
        size = self.page_size_tokens
        full = len(token_ids) // size * size
        try:
            words = array.array("I", token_ids[:full])  # uint32, as the wire carries them
        except OverflowError:
            raise ConfigError(
                f"token ids must be in 0..{2**32 - 1} (got one outside among {full} tokens)"
            ) from None
        if sys.byteorder == "big":
            words.byteswap()  # keys are defined over little-endian token bytes
        return words.tobytes()

    def keys_of_bytes(self, data: bytes, previous: bytes | None = None) -> list[PageKey]:
        """The keys of `token_bytes`' output, chained on `previous` (the key of the page
        before the first one given; None: the root), so a growing prompt keys only its new
        pages."""
        step = 4 * self.page_size_tokens
        out: list[PageKey] = []
        previous = self.root if previous is None else previous
        hash_ = self._hash
        for start in range(0, len(data) - step + 1, step):
            previous = hash_(previous + data[start : start + step])
            out.append(previous)
        return out


ENGINE_ID_SALT = b"hicache-engine-page-id\0"


def keys_of_ids(root: bytes, algorithm: str, ids: Sequence[bytes]) -> list[PageKey]:
    """Keys of pages an engine names itself (`ids`: SGLang's page hashes, each naming its page
    and the whole prefix before it): the namespace's `root` hashed with each id, unchained —
    an id already says what came before. Distinct from any token key (another salt, another
    length), and from another namespace's (another root)."""
    hash_ = _hasher(algorithm)
    prefix = root + ENGINE_ID_SALT
    return [hash_(prefix + page_id) for page_id in ids]


class PackedKeys(Sequence[PageKey]):
    """One group's page keys as a blob of concatenated `KEY_BYTES`-byte keys (the engine
    channel's form). `keys[i]` slices one key; `keys[a:b]` unpacks a run at C speed."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes):
        if len(blob) % KEY_BYTES:
            raise ValueError(
                f"a blob of page keys is a multiple of {KEY_BYTES} bytes (got {len(blob)})"
            )
        self.blob = bytes(blob)

    @classmethod
    def of(cls, keys: Sequence[PageKey]) -> PackedKeys:
        return cls(b"".join(keys))

    def __len__(self) -> int:
        return len(self.blob) // KEY_BYTES

    @overload
    def __getitem__(self, index: int) -> PageKey: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[PageKey]: ...

    def __getitem__(self, index: int | slice) -> PageKey | Sequence[PageKey]:
        count = len(self.blob) // KEY_BYTES
        if isinstance(index, slice):
            start, stop, step = index.indices(count)
            if step != 1:
                return tuple(self[i] for i in range(start, stop, step))
            if stop <= start:
                return ()
            layout = f"{KEY_BYTES}s" * (stop - start)
            return struct.unpack_from(layout, self.blob, start * KEY_BYTES)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError(f"page {index} of {count} keys")
        return self.blob[index * KEY_BYTES : (index + 1) * KEY_BYTES]

    def __iter__(self) -> Iterator[PageKey]:
        return iter(self[0 : len(self)])
