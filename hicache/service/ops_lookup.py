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
passed (`store_waits.py`); its reply says how the wait ended (`store_wait`). The lookups of
one `lookup_many` wait together: the op is bounded by its longest `wait_stored_s`. With
`answer_at_once` it is never held: the engine asks again itself (vLLM's connector).
Every reply, by tokens or by keys, says whether a store in flight writes the page past its
hit (`store_writing`), without waiting."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from hicache.cache import TieredCache
from hicache.channel import protocol as p
from hicache.index import KEY_BYTES, Hit, PackedKeys, PageKey
from hicache.service.dispatch import Later, Reply, Result
from hicache.service.namespaces import Namespace
from hicache.service.sessions import Session
from hicache.service.state import ServerState

Checked = list["Query"]  # each lookup, checked
Shape = Callable[[list[Result]], Result]  # the op's reply from its lookups' replies


@dataclass(frozen=True, slots=True)
class Query:
    """One key lookup, checked: its keys, the tokens asked, the groups whose hit it is about
    (None: all), whether it also wants the pages each group holds (`served`) and how long
    it may wait for a store in flight (`wait_s`, `store_waits.py`)."""

    keys: dict[str, PackedKeys]
    asked: int
    groups: list[str] | None = None
    served: bool = False
    wait_s: float = 0.0
    answer_at_once: bool = False  # never held: the engine asks again while a store writes

    @property
    def hold_s(self) -> float:
        """How long the sidecar may hold the reply for a store in flight (0: never)."""
        return 0.0 if self.answer_at_once else self.wait_s

    def hit(self, cache: TieredCache) -> Hit:
        return cache.lookup_keys(self.keys, self.groups)

    @property
    def named_keys(self) -> dict[str, PackedKeys]:
        """The keys of the groups the hit is about."""
        return {g: k for g, k in self.keys.items() if self.groups is None or g in self.groups}

    def discovery_sets(self, cache: TieredCache) -> list[dict[str, Sequence[PageKey]]]:
        """The keys discovery may ask L3 about, each set of equal length: the named groups'.
        With `served`, the other groups' only up to the whole-prefix groups' run, in a set of
        their own: past it no length is restorable whatever they hold (a cold prompt asks L3
        about its KV pages, not about a state or window page at every position)."""
        named = {g: k for g, k in self.keys.items() if self.groups is None or g in self.groups}
        rules = cache.index.rules
        whole = {g: k for g, k in named.items() if rules[g].needs_whole_prefix}
        if not self.served or not whole:
            return [dict(named)]
        run = min(s.run for s in cache.served_keys(self.keys, list(whole)).values())
        others = {g: k[:run] for g, k in named.items() if g not in whole}
        return [dict(whole), others] if run and others else [dict(whole)]

    def needs_discovery(self, cache: TieredCache, hit: Hit) -> bool:
        """The pages held may lie before the hit's end (a state snapshot at a shorter
        prefix): every unknown page counts then, not only those past the hit."""
        since = Hit(hit.page_size_tokens, 0, 0) if self.served else hit
        return any(
            cache.needs_discovery_keys(keys, since, self.trusts_absent)
            for keys in self.discovery_sets(cache)
        )

    @property
    def trusts_absent(self) -> bool:
        """A lookup that waits for another engine's pages (a decode instance) asks L3 again
        about keys it said moments ago it lacks: its prefill, on another host, may have
        persisted them since (`cache/discovery.py`)."""
        return self.wait_s <= 0


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
        return self._token_reply(cache, args.tokens, hit, tenant)

    async def _discovering(self, cache: TieredCache, tokens: Sequence[int], tenant: str) -> Result:
        await cache.discover(tokens)
        return self._token_reply(cache, tokens, cache.lookup(tokens), tenant)

    def _token_reply(
        self, cache: TieredCache, tokens: Sequence[int], hit: Hit, tenant: str
    ) -> Result:
        writing = self.state.store_waits.writing_tokens(cache, tokens, hit)
        return self._reply(hit, len(tokens), tenant, writing=writing)

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
            return shape([self._no_key_hit(query) for query in checked])
        cache, tenant = namespace.cache, namespace.key.tenant
        waits = self.state.store_waits
        hits = []
        for query in checked:
            hit = query.hit(cache)
            if query.needs_discovery(cache, hit) or (
                query.hold_s > 0 and waits.writing(cache, query.named_keys, hit)
            ):
                return Later(
                    partial(self._discovering_keys, session, cache, checked, shape, tenant)
                )
            hits.append(hit)
        return shape(
            [
                self._key_reply(cache, query, hit, tenant)
                for hit, query in zip(hits, checked, strict=True)
            ]
        )

    async def _discovering_keys(
        self, session: Session, cache: TieredCache, checked: Checked, shape: Shape, tenant: str
    ) -> Result:
        """Every lookup's wait for stores in flight at once (`store_waits.py`: the op lasts
        at most its longest `wait_stored_s`, however many lookups it holds), then, in
        order, L3's pages the index does not know (an earlier one's discovery may extend a
        later one's hit). Its engine's connection gone, the waits end and L3 is not asked:
        no one reads the answer."""
        store_waits = self.state.store_waits
        waited = await asyncio.gather(
            *(
                store_waits.wait(cache, query.keys, query.hold_s, session.gone, query.groups)
                for query in checked
            )
        )
        replies = []
        for query, (_, outcome) in zip(checked, waited, strict=True):
            hit = query.hit(cache)
            # a served lookup twice at most: what L3 adds to the run may bring more of the
            # other groups' pages within it (`Query.discovery_sets`)
            for _ in range(0 if session.gone.is_set() else 2 if query.served else 1):
                if not query.needs_discovery(cache, hit):
                    break
                for keys in query.discovery_sets(cache):
                    await cache.discover_keys(keys, query.trusts_absent)
                hit = query.hit(cache)
            replies.append(self._key_reply(cache, query, hit, tenant, outcome))
        return shape(replies)

    def _key_reply(
        self,
        cache: TieredCache,
        query: Query,
        hit: Hit,
        tenant: str,
        waited: str | None = None,
    ) -> Result:
        writing = self.state.store_waits.writing(cache, query.named_keys, hit)
        reply = self._reply(hit, query.asked, tenant, waited, writing)
        if query.served:  # run: every length up to it; at: the others, listed
            reply["served"] = {
                group: {"run": served.run, "at": list(served.at)}
                for group, served in cache.served_keys(query.keys, query.groups).items()
            }
        return reply

    def _checked(
        self, session: Session, lookups: Sequence[p.KeyLookup], op: str
    ) -> tuple[Namespace | None, Checked]:
        namespace = self.state.readable(session, op)
        many = op == "lookup_many"
        return namespace, [
            self._query(args, f"{op}.lookups.{i}" if many else op) for i, args in enumerate(lookups)
        ]

    def _query(self, args: p.KeyLookup, where: str) -> Query:
        keys, asked = packed_keys(self.state, args.keys, args.num_tokens, where)
        groups = check_groups(self.state, args.groups, where)
        return Query(keys, asked, groups, args.served, args.wait_stored_s, args.answer_at_once)

    def _no_key_hit(self, query: Query) -> Result:
        reply = self._reply(self._no_hit(), query.asked)
        if query.served:
            named = query.groups if query.groups is not None else list(query.keys)
            reply["served"] = {group: {"run": 0, "at": []} for group in named}
        return reply

    def _no_hit(self) -> Hit:
        return Hit(self.state.plan.page_size_tokens, 0, 0, {}, {})

    def _reply(
        self,
        hit: Hit,
        asked: int,
        tenant: str | None = None,
        waited: str | None = None,
        writing: bool = False,
    ) -> Result:
        """`waited`: the outcome of a wait for stores in flight (`store_waits.OUTCOMES`),
        in the reply only when the lookup waited. `writing`: a store in flight writes the
        page past the hit now (`store_writing`, in every reply)."""
        self.state.metrics.lookup(hit.tokens_l2, hit.tokens_total, asked, tenant)
        reply: Result = {
            "page_size_tokens": hit.page_size_tokens,
            "tokens_l2": hit.tokens_l2,
            "tokens_total": hit.tokens_total,
            "store_writing": writing,
        }
        if writing:
            self.state.store_waits.stats.answered_writing += 1
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


def check_groups(state: ServerState, groups: Sequence[str] | None, op: str) -> list[str] | None:
    """A keyed op's `groups` (the ones it is about alone), each a cached group, once."""
    if groups is None:
        return None
    known = list(state.key_groups)
    bad = sorted({g for g in groups if g not in known})
    if bad or len(set(groups)) != len(groups):
        raise p.RequestError(
            p.ErrorCode.BAD_REQUEST,
            f"{op}.groups: {list(groups)} "
            + (f"names groups {bad} this layout does not cache" if bad else "repeats a group")
            + f"; name each at most once of {known}",
        )
    return list(groups)


def _first(replies: list[Result]) -> Result:
    return replies[0]


def _results(replies: list[Result]) -> Result:
    return {"results": replies}
