"""A prompt's page keys on the engine's side: computed once, with the sidecar's own keyers.

The sidecar's `hello` reply carries, for the session's namespace, the page size, the hash
algorithm and each cached group's keyer root. `KeySpec` rebuilds those keyers
(`PageKeyer.from_root`), so `PromptKeys` holds exactly the keys the sidecar's index files the
prompt's pages under — one blob of concatenated 16-byte keys per group, what `lookup_keys` and
`lookup_many` send — and a lookup costs the sidecar no token list to decode, validate and hash.
A growing prompt keys only its new pages (`extend`). An engine that names pages itself (SGLang's
page hashes) gets keys of those ids under the same roots (`of_ids`), for `store_keys` /
`load_keys` / `lookup_keys`.

Keys belong to one namespace (tenant, model, rank, salt): computed under another's roots they
are never found, so a wrong seed misses, it never hits. The client rebuilds its `KeySpec` from
every hello; keys computed under roots a reconnect changed (another tenant salt) are refused
by the client (`ClientBase._key_args`), so they are recomputed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hicache.index import KEY_BYTES, PageKeyer
from hicache.index.keys import keys_of_ids


@dataclass(frozen=True, slots=True)
class PromptKeys:
    """Every cached group's keys of a prompt's full pages (`num_tokens` long; its partial
    trailing page has none), as the engine channel carries them."""

    num_tokens: int
    blobs: Mapping[str, bytes]
    spec: KeySpec

    @property
    def pages(self) -> int:
        return len(next(iter(self.blobs.values()), b"")) // KEY_BYTES

    def args(self) -> dict[str, Any]:
        return {"keys": dict(self.blobs), "num_tokens": self.num_tokens}


class KeySpec:
    """The keyers of one session's namespace, from its hello reply's `keys`."""

    def __init__(self, page_size_tokens: int, algorithm: str, roots: Mapping[str, bytes]):
        self.page_size_tokens = page_size_tokens
        self.algorithm = algorithm
        self.roots = dict(roots)
        self.keyers = {
            group: PageKeyer.from_root(root, page_size_tokens, algorithm)
            for group, root in self.roots.items()
        }

    @classmethod
    def of(cls, reply: Mapping[str, Any]) -> KeySpec | None:
        """From a hello reply; None when the sidecar gives no roots (it predates keys)."""
        keys = reply.get("keys")
        if not isinstance(keys, Mapping):
            return None
        return cls(int(keys["page_size_tokens"]), str(keys["algorithm"]), keys["roots"])

    def same(self, other: KeySpec) -> bool:
        return (self.page_size_tokens, self.algorithm, self.roots) == (
            other.page_size_tokens,
            other.algorithm,
            other.roots,
        )

    def keys(self, tokens: Sequence[int], extend: PromptKeys | None = None) -> PromptKeys:
        """The prompt's keys. `extend`: keys of an earlier, shorter state of this prompt
        (the caller vouches `tokens` starts with its tokens): only later pages are hashed."""
        size = self.page_size_tokens
        if not self.keyers:
            return PromptKeys(len(tokens), {}, self)
        first = next(iter(self.keyers.values()))
        done = 0
        if extend is not None and extend.spec is self and extend.num_tokens <= len(tokens):
            done = extend.pages
        data = first.token_bytes(tokens[done * size :])
        blobs = {}
        for group, keyer in self.keyers.items():
            if done:
                old = extend.blobs[group]  # type: ignore[union-attr]
                new = keyer.keys_of_bytes(data, previous=old[-KEY_BYTES:])
                blobs[group] = old + b"".join(new)
            else:
                blobs[group] = b"".join(keyer.keys_of_bytes(data))
        return PromptKeys(len(tokens), blobs, self)

    def of_ids(self, ids: Sequence[bytes]) -> PromptKeys:
        """Every cached group's keys of pages the engine names itself (`keys_of_ids`), one
        per id, in order: a prompt of `len(ids)` full pages."""
        blobs = {
            group: b"".join(keys_of_ids(root, self.algorithm, ids))
            for group, root in self.roots.items()
        }
        return PromptKeys(len(ids) * self.page_size_tokens, blobs, self)
