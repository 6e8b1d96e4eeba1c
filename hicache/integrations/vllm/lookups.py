"""The vLLM scheduler half's lookups: how much of a prompt the sidecar holds, asked through a
lookup-only session, without vLLM.

vLLM asks `get_num_new_matched_tokens` at every step a request waits, so a request's page keys
are computed here once, with the sidecar's keyers, and only its new pages hashed on later asks
(`lookup_keys`: the sidecar decodes and hashes no token list); a sidecar that predates keys
is asked by tokens. A sidecar that is down, or refuses this engine, gives no hits — never an
exception into vLLM's scheduler — and is tried again at most every `retry_after_s`; an outage
is logged once, not once per request.

A decode instance (`kv_consumer`, `wait_stored_s` > 0) waits for pages a producer's store in
flight is writing without holding vLLM's scheduler thread: it asks with `answer_at_once`, the
sidecar answers at once and says whether a store writes the page past the hit
(`store_writing`), and while one does `lookup` returns None — vLLM's "ask again later"
(`get_num_new_matched_tokens` -> (None, False): the request is skipped this step, stays
waiting, and is asked again at the next). Each wait is timed from the request's first ask
that found a store writing. Lifecycle of one request's wait:
    not waiting   the reply says no store writes past the hit: answered, nothing counted
    waiting       a store writes the next page and the first such ask is < wait_stored_s
                  ago: None (vLLM asks again at a later step)
    -> hit        no store writes there any more and the hit grew since the first ask
    -> missed     no store writes there any more and the hit did not grow (the store
                  failed or was aborted), or the sidecar cannot be asked (no hits)
    -> timed_out  wait_stored_s passed with a store still writing: the hit as it is then
    -> abandoned  the request finished or was aborted while waiting (`forget`)
Each outcome counted once in `store_waits` (the scheduler's stats file, `.scheduler`,
with the waits in progress as `store_waits_waiting`); a request's wait state is dropped at
its outcome, so none outlives its request.

The blocking wait (the sidecar holds the reply up to `wait_stored_s`, vLLM's scheduler
thread with it) is kept only for a sidecar that predates `answer_at_once`: it refuses the
field by name, which is logged once, and its lookups wait there as before (its reply says
how: `store_wait`, counted alike). vLLM itself always asks again after a None.

Lifecycle (vLLM's scheduler thread):
    lookups = Lookups(connect, retry_after_s, wait_stored_s=0)
    with lookups.asking(req_id): book.matched(...)   # the StepBook calls `lookup`; None:
                                                     # a store is writing, ask again later
    lookups.forget(req_id)                           # request finished or aborted
    lookups.close()
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from hicache.channel.protocol import ErrorCode
from hicache.client import Client, ClientError, Lookup, PromptKeys
from hicache.errors import HicacheError

log = logging.getLogger("hicache.vllm")


@dataclass(frozen=True, slots=True)
class StoreWait:
    """A request waiting for a store in flight: since its first ask that found one writing
    (`clock` seconds), and the hit's tokens then."""

    since_s: float
    tokens_before: int


class Lookups:
    def __init__(
        self,
        connect: Callable[[], Client],
        retry_after_s: float,
        *,
        wait_stored_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`connect`: a new lookup-only client (`role: "lookup"`). `wait_stored_s`: how long
        a request waits for pages a store in flight is writing (0: never). `clock`: the
        seconds a wait is measured in."""
        self._connect = connect
        self.retry_after_s = retry_after_s
        self.wait_stored_s = wait_stored_s
        self._clock = clock
        # waits for a store in flight, by how they ended (hit, missed, timed_out, abandoned;
        # drained: a blocking wait the sidecar's drain ended)
        self.store_waits: dict[str, int] = {}
        # requests waiting now, each asked again at vLLM's next steps
        self.waiting: dict[str, StoreWait] = {}
        # False: the sidecar predates `answer_at_once` (its lookups wait there, blocking)
        self.answer_at_once = True
        self.changed = False  # counts changed since the stats file was last written
        self._client: Client | None = None
        self._next_try = 0.0
        self._down = False
        # each request's page keys, computed once and extended as it grows
        self._keys: dict[str, PromptKeys] = {}
        self._asking: str | None = None  # the request whose lookup is in progress
        self._by_keys = True  # False: the sidecar predates lookup_keys

    @contextlib.contextmanager
    def asking(self, req_id: str) -> Iterator[None]:
        """Lookups inside are for `req_id`: its keys are kept for its next ask."""
        self._asking = req_id
        try:
            yield
        finally:
            self._asking = None

    def lookup(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(tokens in L2, tokens in L2 and L3) of the prompt's hit; (0, 0) when the sidecar
        cannot be asked; None while a store in flight writes the page past the hit and the
        request's wait is within `wait_stored_s` (ask again later)."""
        client = self._client
        if client is None:
            now = time.monotonic()
            if now < self._next_try:
                return self._no_hits()
            self._next_try = now + self.retry_after_s
            try:
                client = self._client = self._connect()
            except (HicacheError, OSError) as exc:
                self._failed(f"hicache sidecar not reachable, no hits meanwhile: {exc}")
                return self._no_hits()
        try:
            hit = self._by_page_keys(client, tokens) if self._by_keys else None
            if hit is None:
                hit = client.lookup(tokens)
        except (HicacheError, OSError) as exc:
            self._failed(f"hicache lookup failed, no hits meanwhile: {exc}")
            return self._no_hits()
        if self._down:
            log.info("hicache lookups answered again")
            self._down = False
        if hit.store_wait is not None:  # a blocking wait (an older sidecar's) ended
            self._count(hit.store_wait)
        if self._ask_again(hit):
            return None
        return int(hit.tokens_l2), int(hit.tokens_total)

    def _ask_again(self, hit: Lookup) -> bool:
        """Should vLLM ask again later (a store writes the page past the hit, the request's
        wait within its bound)? A wait that ends here is counted."""
        req_id = self._asking
        if req_id is None or not hit.store_writing or self.wait_stored_s <= 0:
            # not writing (or a sidecar that does not say): a wait in progress ended
            wait = None if req_id is None else self.waiting.pop(req_id, None)
            if wait is not None:
                self._count("hit" if hit.tokens_total > wait.tokens_before else "missed")
            return False
        now = self._clock()
        wait = self.waiting.get(req_id)
        if wait is None:
            wait = self.waiting[req_id] = StoreWait(now, int(hit.tokens_total))
            self.changed = True
        if now - wait.since_s < self.wait_stored_s:
            return True
        del self.waiting[req_id]
        self._count("timed_out")
        return False

    def _no_hits(self) -> tuple[int, int]:
        """The sidecar cannot be asked: no hits; the asking request's wait ends missed."""
        wait = None if self._asking is None else self.waiting.pop(self._asking, None)
        if wait is not None:
            self._count("missed")
        return 0, 0

    def _count(self, outcome: str) -> None:
        self.store_waits[outcome] = self.store_waits.get(outcome, 0) + 1
        self.changed = True

    def _by_page_keys(self, client: Client, tokens: Sequence[int]) -> Lookup | None:
        """The lookup by page keys (only the request's new pages hashed); None: the sidecar
        predates keys."""
        try:
            keys = client.page_keys(tokens, extend=self._keys.get(self._asking or ""))
        except ClientError as exc:
            if exc.code != ErrorCode.UNKNOWN_OP:
                raise
            self._by_keys = False
            return None
        if self._asking is not None:
            self._keys[self._asking] = keys
        while True:
            wait_s = self.wait_stored_s
            at_once = self.answer_at_once and wait_s > 0
            try:
                return client.lookup_keys(keys, wait_stored_s=wait_s, answer_at_once=at_once)
            except ClientError as exc:
                if at_once and refused_field(exc, "answer_at_once"):
                    log.warning(
                        "kv_connector_extra_config.store_wait_s %g: the sidecar predates "
                        "answers that say a store is writing (answer_at_once); its lookups "
                        "wait there, holding vLLM's scheduler thread up to %g s (%s)",
                        wait_s,
                        wait_s,
                        exc,
                    )
                    self.answer_at_once = False
                elif wait_s > 0 and refused_field(exc, "wait_stored_s"):
                    log.warning(
                        "kv_connector_extra_config.store_wait_s %g: the sidecar predates "
                        "waits for stores in flight; its lookups answer at once (%s)",
                        wait_s,
                        exc,
                    )
                    self.wait_stored_s = 0.0
                else:
                    raise

    def _failed(self, message: str) -> None:
        if "refused:" in message:  # a wrong token or another model: not an outage, say so
            if not self._down:
                log.error(message)
        elif not self._down:  # once per outage, not once per request
            log.warning(message)
        self._down = True

    def write_stats(self, path: Path, **fields: object) -> None:
        """`fields` and the waits for stores in flight by outcome, as JSON at `path`
        (replaced atomically), when the waits changed since the last write; a path that
        cannot be written is logged, never raised into vLLM."""
        if not self.changed:
            return
        self.changed = False
        counts = {
            **fields,
            "store_wait_s": self.wait_stored_s,
            "store_waits": self.store_waits,
            "store_waits_waiting": len(self.waiting),
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(counts))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("kv_connector_extra_config.stats_path %s: cannot write: %s", path, exc)

    def forget(self, req_id: str) -> None:
        """The request finished or was aborted: its keys and wait state dropped (a wait in
        progress counted `abandoned`)."""
        self._keys.pop(req_id, None)
        if self.waiting.pop(req_id, None) is not None:
            self._count("abandoned")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def refused_field(exc: ClientError, field: str) -> bool:
    """Did a sidecar that predates `field` refuse the request for it (an unknown field)?"""
    return exc.code == ErrorCode.BAD_REQUEST and f".{field}: Extra inputs" in str(exc)
