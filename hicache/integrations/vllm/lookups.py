"""The vLLM scheduler half's lookups: how much of a prompt the sidecar holds, asked through a
lookup-only session, without vLLM.

vLLM asks `get_num_new_matched_tokens` at every step a request waits, so a request's page keys
are computed here once, with the sidecar's keyers, and only its new pages hashed on later asks
(`lookup_keys`: the sidecar decodes and hashes no token list); a sidecar that predates keys
is asked by tokens. A sidecar that is down, or refuses this engine, gives no hits — never an
exception into vLLM's scheduler — and is tried again at most every `retry_after_s`; an outage
is logged once, not once per request.

A decode instance (`kv_consumer`) asks with `wait_stored_s`: when the hit stops at a page a
producer's store in flight is writing, the sidecar answers once that store ended or the bound
passed (`service/store_waits.py`), holding vLLM's scheduler thread at most that long; how
each wait ended is counted here (`store_waits`, in the scheduler's stats file).

Lifecycle (vLLM's scheduler thread):
    lookups = Lookups(connect, retry_after_s, wait_stored_s=0)
    with lookups.asking(req_id): book.matched(...)   # the StepBook calls `lookup`
    lookups.forget(req_id)                           # request finished
    lookups.close()
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from hicache.channel.protocol import ErrorCode
from hicache.client import Client, ClientError, Lookup, PromptKeys
from hicache.errors import HicacheError

log = logging.getLogger("hicache.vllm")


class Lookups:
    def __init__(
        self, connect: Callable[[], Client], retry_after_s: float, *, wait_stored_s: float = 0.0
    ):
        """`connect`: a new lookup-only client (`role: "lookup"`). `wait_stored_s`: how long
        a lookup waits for pages a store in flight is writing (0: never)."""
        self._connect = connect
        self.retry_after_s = retry_after_s
        self.wait_stored_s = wait_stored_s
        # lookups that waited for a store in flight, by how the wait ended (hit, missed,
        # timed_out, drained)
        self.store_waits: dict[str, int] = {}
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
        try:
            hit = client.lookup_keys(keys, wait_stored_s=self.wait_stored_s)
        except ClientError as exc:
            if not refused_field(exc, "wait_stored_s"):
                raise
            log.warning(
                "kv_connector_extra_config.store_wait_s %g: the sidecar predates waits for "
                "stores in flight; its lookups answer at once (%s)",
                self.wait_stored_s,
                exc,
            )
            self.wait_stored_s = 0.0
            hit = client.lookup_keys(keys)
        if hit.store_wait is not None:
            self.store_waits[hit.store_wait] = self.store_waits.get(hit.store_wait, 0) + 1
            self.changed = True
        return hit

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
        counts = {**fields, "store_wait_s": self.wait_stored_s, "store_waits": self.store_waits}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(counts))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("kv_connector_extra_config.stats_path %s: cannot write: %s", path, exc)

    def forget(self, req_id: str) -> None:
        self._keys.pop(req_id, None)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def refused_field(exc: ClientError, field: str) -> bool:
    """Did a sidecar that predates `field` refuse the request for it (an unknown field)?"""
    return exc.code == ErrorCode.BAD_REQUEST and f".{field}: Extra inputs" in str(exc)
