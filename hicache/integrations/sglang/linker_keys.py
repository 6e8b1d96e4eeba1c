"""SGLang's page hashes as hicache page keys, and lookup answers as SGLang's restorable lengths.
Pure (no sglang import).

SGLang hands a `UnifiedCacheLinker` no token ids: a lookup, load or offload names each page by
its storage hash (`get_storage_hash_str`: a 64-hex SHA-256 chained over the page's tokens and
every page before it, seeded by the request's extra key and cache salt), and the pages of one
call start wherever SGLang's device cache or tree node starts. hicache's own keys chain from
the namespace root over token ids, so they cannot be computed from these. The linker keys
them exactly as the HiCache storage backend does (`storage_backend.page_ids`): each hash is an
engine page id under the session's namespace (`KeySpec.of_ids`: the namespace root hashed with
the id, unchained — the hash already covers the prefix), so a key says the same page wherever
a call starts, and two namespaces never share one. Stores and loads go as the keyed ops
(`Client.store_keys` / `Client.load_keys`), lookups as `lookup_keys`.

A hash is checked before it is keyed (64 hex digits): anything else is a caller's bug, refused
by value rather than filed under a key nobody else computes.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.client.keys import KeySpec, PromptKeys
from hicache.errors import ConfigError

DIGEST_BYTES = 32  # SHA-256


def digest_of(page_hash: str) -> bytes:
    """One SGLang page hash (64 hex digits) as its 32 bytes; anything else is refused."""
    if not isinstance(page_hash, str) or len(page_hash) != 2 * DIGEST_BYTES:
        raise ConfigError(
            f"SGLang page hash {page_hash!r:.80} is not {2 * DIGEST_BYTES} hex digits "
            "(get_storage_hash_str's SHA-256)"
        )
    try:
        return bytes.fromhex(page_hash)
    except ValueError:
        raise ConfigError(f"SGLang page hash {page_hash!r} is not hexadecimal") from None


def page_ids_of_hashes(page_hashes: Sequence[str]) -> list[bytes]:
    """The hashes, each checked (`digest_of`), as the engine page ids the backend sends too."""
    for page_hash in page_hashes:
        digest_of(page_hash)
    return [page_hash.encode() for page_hash in page_hashes]


def keys_of_hashes(spec: KeySpec, page_hashes: Sequence[str]) -> PromptKeys:
    """Every cached group's key of each page, in order, as the keyed ops carry them."""
    return spec.of_ids(page_ids_of_hashes(page_hashes))


def restorable_lengths(tokens_hit: int, page_size_tokens: int, pages_asked: int) -> list[int]:
    """A lookup's answer as `UnifiedCacheLinker.lookup` gives it: every prefix length in pages
    that is restorable (full attention only: each one up to the hit), at most `pages_asked`."""
    pages = min(tokens_hit // page_size_tokens, pages_asked)
    return list(range(1, pages + 1))
