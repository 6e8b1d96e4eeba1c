"""vLLM's prefix-cache block hashes, computed by the sidecar from a prompt's token ids, so the
KV events it publishes (`kv_events.py`) name blocks exactly as a KV-aware router (and vLLM's
own publisher) names them — without importing vLLM.

vLLM 0.32 (`vllm/v1/core/kv_cache_utils.py`): block i's hash is
`hash_fn((parent, tuple(block_tokens), extra_keys))`, the parent being block i-1's hash, or
for block 0 `NONE_HASH = hash_fn(seed)`; `seed` is `PYTHONHASHSEED` when the engines set it,
else `"vllm-none-hash"` for the cryptographic algorithms (the only ones reproducible across
processes, so the only ones offered here). `hash_fn` is `prefix_caching_hash_algo`: `sha256`
(the default: SHA-256 over `pickle.dumps(..., HIGHEST_PROTOCOL)`) or `sha256_cbor` (SHA-256
over canonical CBOR, written out below for the three shapes it ever sees: a text seed, and
`(bytes, (int, ...), None)`). `extra_keys` is None here: requests with LoRA adapters,
multimodal inputs, a `cache_salt` or prompt embeddings hash differently, and the sidecar sees
only their tokens. The hash published (`ExternalBlockHash`) is the 32 bytes, or with
`int_hashes` (vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`) their big-endian low 64 bits.
A hicache page is one vLLM block: the connector runs with `page_size_tokens` = block size."""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any, Literal

HashAlgo = Literal["sha256", "sha256_cbor"]
DEFAULT_SEED = "vllm-none-hash"


def _cbor_head(major: int, value: int) -> bytes:
    """A CBOR item head with the shortest argument (what canonical encoding requires)."""
    if value < 24:
        return bytes([major << 5 | value])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        try:
            return bytes([major << 5 | extra]) + struct.pack(fmt, value)
        except struct.error:
            continue
    raise ValueError(f"CBOR argument {value} does not fit 64 bits")


def _cbor(value: Any) -> bytes:
    """Canonical CBOR of a text seed or a `(parent, tokens, None)` block key."""
    if isinstance(value, str):
        data = value.encode()
        return _cbor_head(3, len(data)) + data
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if value is None:
        return b"\xf6"
    if isinstance(value, int) and value >= 0:
        return _cbor_head(0, value)
    if isinstance(value, tuple):
        return _cbor_head(4, len(value)) + b"".join(_cbor(v) for v in value)
    raise TypeError(f"no CBOR encoding here for {type(value).__name__} {value!r}")


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(_cbor(value)).digest()


HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
}


class BlockHasher:
    """One algorithm and seed: `none_hash`, `block` (one block's hash from its parent's) and
    `external` (what an event carries)."""

    def __init__(
        self, algo: HashAlgo = "sha256", seed: str = DEFAULT_SEED, *, int_hashes: bool = False
    ):
        if algo not in HASH_FUNCTIONS:
            raise ValueError(
                f"prefix caching hash {algo!r} is not one the sidecar computes; allowed: "
                f"{sorted(HASH_FUNCTIONS)} (vLLM's reproducible ones)"
            )
        self.algo = algo
        self._fn = HASH_FUNCTIONS[algo]
        self.none_hash = self._fn(seed)
        self.int_hashes = bool(int_hashes)

    def block(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        return self._fn((parent or self.none_hash, tuple(tokens), None))

    def chain(self, tokens: Sequence[int], block_size: int) -> list[bytes]:
        """Every full block's hash of a prompt (tests, and a store's first pages)."""
        hashes: list[bytes] = []
        parent: bytes | None = None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = self.block(parent, tokens[start : start + block_size])
            hashes.append(parent)
        return hashes

    def external(self, block_hash: bytes) -> bytes | int:
        if self.int_hashes:
            return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)
        return block_hash
