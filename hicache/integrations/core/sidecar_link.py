"""`SidecarLink`: an engine adapter's one client of `hicache serve`, shared by the engine's
threads, with the failure bookkeeping every adapter needs: nothing the sidecar does (down,
restarted, refusing, slow) ever reaches the engine as an exception.

    link = SidecarLink(connect, on_connect, retry_after_s=1.0, name="sglang")
    hits = link.use("lookup", lambda client: client.lookup_keys(keys), default=None)
    link.close()

States: idle (no client yet) -> up (connected; `on_connect(client)` ran: the engine's pools
registered) -> down (a connect or call failed on the connection: the client is closed, one
warning logged for the outage, every use answers its default without trying until
`retry_after_s` has passed, then the next use connects again) -> up again ("back" logged
once) ... -> closed (`close()`: terminal; every use answers its default). `detach(client,
why)`: up -> down at once (a session whose ops may still touch the engine's memory is
dropped) -> up again at once when the sidecar registers the memory anew, which it does only
once the old session's ops settled (True), else down as after any outage. A refusal (the
sidecar answered an error to one call) or any other error inside a call answers the default
and leaves the link up; each is logged, at most once per `retry_after_s` per op. The client
itself reconnects once inside a call (a restarted sidecar) and replays the pool registration
on its own. An adapter that finds a client unusable outside a `use` (a load it cannot confirm
stopped: the SGLang linker's) calls `drop(client, why)`: up -> down as a failed connection does
(the client closed, so the sidecar ends what it still did for it); a client that is no longer
the link's current one is only closed.

Thread safety: connecting and closing hold the link's lock; calls run on the client, which
sends one request at a time (its own lock), so the engine's threads may use one link at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from hicache.client import Client, ClientError

T = TypeVar("T")
D = TypeVar("D")


@dataclass
class LinkCounters:
    """What the link saw (read by the adapter's stats)."""

    connects: int = 0
    outages: int = 0
    refusals: int = 0  # calls the sidecar answered with an error
    errors: int = 0  # calls that failed any other way (load failed, timed out, ...)


class SidecarLink:
    def __init__(
        self,
        connect: Callable[[], Client],
        on_connect: Callable[[Client], None],
        *,
        retry_after_s: float,
        name: str,
        log: logging.Logger,
    ):
        self._connect = connect
        self._on_connect = on_connect
        self.retry_after_s = retry_after_s
        self.name = name
        self._log = log
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._closed = False
        self._down_since: float | None = None
        self._next_try = 0.0
        self._last_logged: dict[str, float] = {}
        self.counters = LinkCounters()

    @property
    def up(self) -> bool:
        return self._client is not None

    def client(self) -> Client | None:
        """The connected client, connecting when due; None while down or closed."""
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._closed:
                return None
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._next_try:
                return None
            self._next_try = now + self.retry_after_s
            try:
                client = self._connect()
            except Exception as exc:
                self._went_down(f"cannot attach: {exc}")
                return None
            try:
                self._on_connect(client)
            except Exception as exc:
                client.close()
                self._went_down(f"attached but could not register the engine's pools: {exc}")
                return None
            self.counters.connects += 1
            if self._down_since is not None:
                self._log.warning(
                    "hicache %s: sidecar back after %.1f s",
                    self.name,
                    time.monotonic() - self._down_since,
                )
                self._down_since = None
            self._client = client
            return client

    def use(self, op: str, call: Callable[[Client], T], default: D) -> T | D:
        """`call(client)`'s result, or `default` when the sidecar is down, refuses, or the
        call fails any way (see the module doc); never raises."""
        client = self.client()
        if client is None:
            return default
        try:
            return call(client)
        except (ConnectionError, OSError) as exc:
            self.drop(client, f"{op} failed on the connection: {exc}")
        except ClientError as exc:
            self.counters.refusals += 1
            self._rate_limited(op, f"hicache {self.name}: the sidecar refused {op}: {exc}")
        except Exception as exc:
            self.counters.errors += 1
            self._rate_limited(op, f"hicache {self.name}: {op} failed: {type(exc).__name__}: {exc}")
        return default

    def detach(self, client: Client, why: str) -> bool:
        """Drop `client`'s session (its ops may still touch the engine's memory: a load that
        did not end, `core.load_end`) and attach again at once. The sidecar ends a session
        whose connection is gone only once its ops settled, and registers the same memory for
        a new session only after that (`service/claims.py`), so True is its word that the old
        session's copies are over; False: not confirmed (down, or the old session still
        ending), the link is down and tried again every `retry_after_s`, whose registration
        again waits for the old session."""
        self.drop(client, why)
        with self._lock:
            self._next_try = 0.0
        return self.client() is not None

    def note(self, topic: str, message: str) -> None:
        """A warning the adapter has about the engine's use of the sidecar (not a failure of
        a call), logged at most once per `retry_after_s` per topic."""
        self._rate_limited(topic, message)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def drop(self, client: Client, why: str) -> None:
        """`client` is unusable (`why`): closed; the link goes down if it was its client."""
        with self._lock:
            if self._client is client:
                self._client = None
                self._next_try = time.monotonic() + self.retry_after_s
                self._went_down(why)
        client.close()

    def _went_down(self, why: str) -> None:
        """(the lock held) An outage starts, or goes on: logged once per outage."""
        if self._down_since is None:
            self._down_since = time.monotonic()
            self.counters.outages += 1
            self._log.warning(
                "hicache %s: sidecar unavailable (%s); serving without it, retrying every %.1f s",
                self.name,
                why,
                self.retry_after_s,
            )

    def _rate_limited(self, op: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last_logged.get(op, -1e9) >= self.retry_after_s:
            self._last_logged[op] = now
            self._log.warning(message)
