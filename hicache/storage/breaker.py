"""`CircuitBreaker`: turns a failing L3 backend into fast misses, and lets it back in.

Closed: calls go through; `failure_threshold` failures in a row open it. Open: calls are
refused at once (the store reports misses). After `reset_after_s` it is half-open: one trial
call goes through; its success closes the breaker, its failure re-opens it, and a trial that
ends neither way (its caller was cancelled) is `abandon`ed so the next call may try.

The sidecar's probe task (`GuardedStore.probe`, every `PROBE_INTERVAL_S`) does not wait for
`reset_after_s`: while the breaker is open or half-open it takes the trial (`allow_probe`:
one call at a time), since its cheap call costs no engine request anything. So a backend
that came back is let in within one probe interval and one call, whatever `reset_after_s`
says (#32: with only the half-open trial, hits stayed away for up to `reset_after_s` and a
probe tick after an outage ended); `reset_after_s` still spaces the trials engine calls
make, each of which pays the call's timeout while the backend is down.

Both thresholds are constructor parameters (defaults: 3 failures, 5 s), checked there.
`failure(why)` keeps the reason of the latest failure; `describe()` is what a readiness
probe lists: the state, why, failures in a row and how long until the next trial. `outages`
counts the times it closed after being open: the backend is back, perhaps empty (a restarted
server), which the cache checks (`hicache/cache/resync.py`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any

DEFAULT_FAILURE_THRESHOLD = 3
DEFAULT_RESET_AFTER_S = 5.0
PROBE_INTERVAL_S = 1.0  # the background probe's period (at most `reset_after_s / 2`)


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        reset_after_s: float = DEFAULT_RESET_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if isinstance(failure_threshold, bool) or not isinstance(failure_threshold, int):
            raise TypeError(
                f"CircuitBreaker failure_threshold={failure_threshold!r}: must be an int >= 1"
            )
        if failure_threshold < 1:
            raise ValueError(
                f"CircuitBreaker failure_threshold={failure_threshold}: must be >= 1 "
                "(failures in a row before the breaker opens)"
            )
        if not (isinstance(reset_after_s, int | float) and math.isfinite(reset_after_s)) or (
            reset_after_s < 0
        ):
            raise ValueError(
                f"CircuitBreaker reset_after_s={reset_after_s!r}: must be a finite number of "
                "seconds >= 0 (how long it stays open before a trial call)"
            )
        self.failure_threshold = failure_threshold
        self.reset_after_s = float(reset_after_s)
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_in_flight = False
        self.last_failure: str | None = None  # the latest failure's reason, kept after closing
        self.outages = 0  # open -> closed transitions: the backend is back, maybe empty

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at >= self.reset_after_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allow(self) -> bool:
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def allow_probe(self) -> bool:
        """May the background probe make its call now? While open or half-open, when no
        other trial is in flight (it then takes the trial): it does not wait for
        `reset_after_s`. Closed: nothing to find out."""
        if self._opened_at is None or self._trial_in_flight:
            return False
        self._trial_in_flight = True
        return True

    def success(self) -> None:
        self._failures = 0
        if self._opened_at is not None:
            self.outages += 1
        self._opened_at = None
        self._trial_in_flight = False

    def failure(self, why: str | None = None) -> None:
        """A call failed (`why`: what and how, e.g. "get:timeout")."""
        self._trial_in_flight = False
        self.last_failure = why
        self._failures += 1
        if self._opened_at is not None or self._failures >= self.failure_threshold:
            self._opened_at = self._clock()

    def abandon(self) -> None:
        """A call `allow` let through ended with no verdict (its caller was cancelled): a
        half-open trial is free again. Counts neither way."""
        self._trial_in_flight = False

    def describe(self) -> dict[str, Any]:
        """The breaker for a readiness or stats answer: state, the latest failure's reason,
        failures in a row, and (open) seconds until a trial may go through."""
        state = self.state
        retry_in = None
        if state is BreakerState.OPEN and self._opened_at is not None:
            retry_in = max(0.0, self._opened_at + self.reset_after_s - self._clock())
        return {
            "state": state.value,
            "why": self.last_failure,
            "failures_in_a_row": self._failures,
            "trial_in_s": None if retry_in is None else round(retry_in, 3),
        }
