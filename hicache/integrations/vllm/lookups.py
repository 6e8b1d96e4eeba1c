"""The vLLM scheduler half's lookups: how much of a prompt the sidecar holds, asked through a
lookup-only session, without vLLM.

vLLM asks `get_num_new_matched_tokens` at every step a request waits, so a request's page keys
are computed here once, with the sidecar's keyers, and only its new pages hashed on later asks
(`lookup_keys`: the sidecar decodes and hashes no token list); a sidecar that predates keys
is asked by tokens. A sidecar that is down, or refuses this engine, gives no hits — never an
exception into vLLM's scheduler — and is tried again at most every `retry_after_s`; an outage
is logged once, not once per request.

Lifecycle (vLLM's scheduler thread):
    lookups = Lookups(connect, retry_after_s)
    with lookups.asking(req_id): book.matched(...)   # the StepBook calls `lookup`
    lookups.forget(req_id)                           # request finished
    lookups.close()
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence

from hicache.channel.protocol import ErrorCode
from hicache.client import Client, ClientError, Lookup, PromptKeys
from hicache.errors import HicacheError

log = logging.getLogger("hicache.vllm")


class Lookups:
    def __init__(self, connect: Callable[[], Client], retry_after_s: float):
        """`connect`: a new lookup-only client (`role: "lookup"`)."""
        self._connect = connect
        self.retry_after_s = retry_after_s
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

    def lookup(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(tokens in L2, tokens in L2 and L3) of the prompt's hit; (0, 0) when the sidecar
        cannot be asked."""
        client = self._client
        if client is None:
            now = time.monotonic()
            if now < self._next_try:
                return 0, 0
            self._next_try = now + self.retry_after_s
            try:
                client = self._client = self._connect()
            except (HicacheError, OSError) as exc:
                self._failed(f"hicache sidecar not reachable, no hits meanwhile: {exc}")
                return 0, 0
        try:
            hit = self._by_page_keys(client, tokens) if self._by_keys else None
            if hit is None:
                hit = client.lookup(tokens)
        except (HicacheError, OSError) as exc:
            self._failed(f"hicache lookup failed, no hits meanwhile: {exc}")
            return 0, 0
        if self._down:
            log.info("hicache lookups answered again")
            self._down = False
        return int(hit.tokens_l2), int(hit.tokens_total)

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
        return client.lookup_keys(keys)

    def _failed(self, message: str) -> None:
        if "refused:" in message:  # a wrong token or another model: not an outage, say so
            if not self._down:
                log.error(message)
        elif not self._down:  # once per outage, not once per request
            log.warning(message)
        self._down = True

    def forget(self, req_id: str) -> None:
        self._keys.pop(req_id, None)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
