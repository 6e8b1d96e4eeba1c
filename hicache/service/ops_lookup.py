"""`LookupOps`: how much of a prompt the cache holds — `lookup` (by tokens), `lookup_keys` (by
the page keys the engine computed itself) and `lookup_many` (several key lookups in one frame)
— over the server's explicit state (`ServerState`).

Each op is one handler: the hit from the index, answered inline (no await) when L3 cannot
extend it; otherwise a `Later` that asks L3 about the pages the index does not know
(discovery) and answers with the hit after it. Nothing is counted before the answer, so a
lookup is counted once either way.

A lookup by keys is the token lookup without decoding, validating and hashing a token list:
the blobs are checked (whole keys, the same count in every cached group, at most `MAX_TOKENS`
tokens' worth, `num_tokens` consistent with them), looked up as they are, and the reply is
the token lookup's, discovery included. A key lookup with `wait_stored_s` whose hit stops at
a page a store in flight is writing is answered later, once that store ended or the bound
passed (`store_waits.py`); its reply says how the wait ended (`store_wait`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial

from hicache.cache import TieredCache
from hicache.channel import protocol as p
from hicache.index import KEY_BYTES, Hit, PackedKeys
from hicache.service.dispatch import Later, Reply, Result
from hicache.service.namespaces import Namespace
from hicache.service.sessions import Session
from hicache.service.state import ServerState

# each lookup's keys, tokens asked and how long it may wait for stores in flight
Checked = list[tuple[dict[str, PackedKeys], int, float]]
Shape = Callable[[list[Result]], Result]  # the op's reply from its lookups' replies


class LookupOps:
    def __init__(self, state: ServerState):
        self.state = state

    def lookup(self, session: Session, args: p.Tokens) -> Reply:
        namespace = self.state.readable(session, "lookup")
        if namespace is None:
            return self._reply(self._no_hit(), len(args.tokens))
        cache = namespace.cache
        hit = cache.lookup(args.tokens)
        tenant = namespace.key.tenant
        if cache.needs_discovery(args.tokens, hit):  # ask L3 first
            return Later(partial(self._discovering, cache, args.tokens, tenant))
        return self._reply(hit, len(args.tokens), tenant)

    async def _discovering(self, cache: TieredCache, tokens: Sequence[int], tenant: str) -> Result:
        await cache.discover(tokens)
        return self._reply(cache.lookup(tokens), len(tokens), tenant)

    def lookup_keys(self, session: Session, args: p.KeyLookup) -> Reply:
        return self._key_lookups(session, [args], "lookup_keys", _first)

    def lookup_many(self, session: Session, args: p.LookupMany) -> Reply:
        return self._key_lookups(session, args.lookups, "lookup_many", _results)

    def _key_lookups(
        self, session: Session, lookups: Sequence[p.KeyLookup], op: str, shape: Shape
    ) -> Reply:
        """The hits inline; or, when L3 may extend any, a `Later` that looks all of them up
        again in order, asking L3 about each that needs it (an earlier one's discovery may
        extend a later one's hit)."""
        namespace, checked = self._checked(session, lookups, op)
        if namespace is None:
            return shape([self._reply(self._no_hit(), asked) for _, asked, _ in checked])
        cache, tenant = namespace.cache, namespace.key.tenant
        waits = self.state.store_waits
        hits = []
        for keys, _, wait_s in checked:
            hit = cache.lookup_keys(keys)
            if cache.needs_discovery_keys(keys, hit) or (
                wait_s > 0 and waits.writing(cache, keys, hit)
            ):
                return Later(partial(self._discovering_keys, cache, checked, shape, tenant))
            hits.append(hit)
        return shape(
            [
                self._reply(hit, asked, tenant)
                for hit, (_, asked, _) in zip(hits, checked, strict=True)
            ]
        )

    async def _discovering_keys(
        self, cache: TieredCache, checked: Checked, shape: Shape, tenant: str
    ) -> Result:
        """In order: each lookup's wait for stores in flight (`store_waits.py`), then L3's
        pages the index does not know."""
        replies = []
        for keys, asked, wait_s in checked:
            hit, waited = await self.state.store_waits.wait(cache, keys, wait_s)
            if cache.needs_discovery_keys(keys, hit):
                await cache.discover_keys(keys)
                hit = cache.lookup_keys(keys)
            replies.append(self._reply(hit, asked, tenant, waited))
        return shape(replies)

    def _checked(
        self, session: Session, lookups: Sequence[p.KeyLookup], op: str
    ) -> tuple[Namespace | None, Checked]:
        namespace = self.state.readable(session, op)
        many = op == "lookup_many"
        return namespace, [
            self._packed_keys(args, f"{op}.lookups.{i}" if many else op)
            for i, args in enumerate(lookups)
        ]

    def _packed_keys(
        self, args: p.KeyLookup, where: str
    ) -> tuple[dict[str, PackedKeys], int, float]:
        keys, asked = packed_keys(self.state, args.keys, args.num_tokens, where)
        return keys, asked, args.wait_stored_s

    def _no_hit(self) -> Hit:
        return Hit(self.state.plan.page_size_tokens, 0, 0, {}, {})

    def _reply(
        self, hit: Hit, asked: int, tenant: str | None = None, waited: str | None = None
    ) -> Result:
        """`waited`: the outcome of a wait for stores in flight (`store_waits.OUTCOMES`),
        in the reply only when the lookup waited."""
        self.state.metrics.lookup(hit.tokens_l2, hit.tokens_total, asked, tenant)
        reply: Result = {
            "page_size_tokens": hit.page_size_tokens,
            "tokens_l2": hit.tokens_l2,
            "tokens_total": hit.tokens_total,
        }
        if waited is not None:
            reply["store_wait"] = waited
            self.state.metrics.store_waits.labels(waited).inc()
        return reply


def packed_keys(
    state: ServerState, blobs: Mapping[str, bytes], num_tokens: int | None, where: str
) -> tuple[dict[str, PackedKeys], int]:
    """A prompt's key blobs, checked: every cached group, whole keys, the same count in each,
    at most MAX_TOKENS tokens' worth; and the prompt's length they imply (`num_tokens`, when
    given, must agree). `where`: the op and field, for the error."""
    page = state.plan.page_size_tokens
    groups = state.key_groups
    missing = sorted(set(groups) - set(blobs))
    unknown = sorted(set(blobs) - set(groups))
    if missing or unknown:
        what = "; ".join(
            part
            for part in (
                f"groups {missing} missing" if missing else "",
                f"groups {unknown} are not cached here" if unknown else "",
            )
            if part
        )
        raise p.RequestError(
            p.ErrorCode.BAD_REQUEST,
            f"{where}.keys: {what}; give the keys of exactly {list(groups)} "
            "(hello's keys.roots names them)",
        )
    counts = {}
    for group, blob in blobs.items():
        count, rest = divmod(len(blob), KEY_BYTES)
        if rest:
            raise p.RequestError(
                p.ErrorCode.BAD_REQUEST,
                f"{where}.keys.{group}: the engine sent {len(blob)} bytes, not a whole number "
                f"of {KEY_BYTES}-byte page keys; send the group's keys concatenated",
            )
        if count * page > p.MAX_TOKENS:
            raise p.RequestError(
                p.ErrorCode.BAD_REQUEST,
                f"{where}.keys.{group}: the engine sent {count} keys, {count * page} tokens "
                f"at {page} tokens per page; a lookup covers at most {p.MAX_TOKENS} tokens "
                f"({p.MAX_TOKENS // page} keys)",
            )
        counts[group] = count
    pages = min(counts.values(), default=0)
    if any(count != pages for count in counts.values()):
        raise p.RequestError(
            p.ErrorCode.BAD_REQUEST,
            f"{where}.keys: the engine sent {counts} keys per group; a prompt has one key "
            "per full page in every group",
        )
    asked = pages * page if num_tokens is None else num_tokens
    if asked // page != pages:
        raise p.RequestError(
            p.ErrorCode.BAD_REQUEST,
            f"{where}.num_tokens: {asked} tokens are {asked // page} full pages of {page} "
            f"tokens; the engine sent {pages} keys per group",
        )
    return {group: PackedKeys(blob) for group, blob in blobs.items()}, asked


def _first(replies: list[Result]) -> Result:
    return replies[0]


def _results(replies: list[Result]) -> Result:
    return {"results": replies}
