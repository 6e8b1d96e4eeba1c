"""`ReadRate`: L3's recent read rate in bytes per second, as the cache sees it — what the
`timeout` prefetch policy's auto deadline is sized by.

Each L3 -> L2 fetch that returned verified bytes is one sample: the bytes L3 read while it
ran — its own verified bytes plus those the reads already in flight when it started had
asked for (L3 serves those meanwhile, in order or shared) — and the seconds from its start
to its return. So concurrent engines queueing behind one another measure L3's rate, not
the queue, and a new fetch's deadline counts the bytes ahead of it (`L3Io.reading_bytes`).
Bytes and seconds are averaged separately (exponentially weighted, `weight` for the newest
sample) and the rate is their ratio, so a large read counts for more than a small one and
one stalled read does not zero the rate. A read that verified nothing (L3 down, the breaker
open, every key absent) is no sample: it says nothing about how fast L3 reads, and an outage
must not stretch the deadlines of the loads that follow it. Lifecycle: one per `L3Io`,
living as long as the cache (a store attached in place of another starts from no
measurement); `observe` after each fetch, `bytes_per_s` whenever a load sizes its wait.
"""

from __future__ import annotations

import math


class ReadRate:
    def __init__(self, weight: float = 0.25):
        if not (isinstance(weight, int | float) and math.isfinite(weight)) or not 0 < weight <= 1:
            raise ValueError(f"ReadRate weight={weight!r}: must be a number in (0, 1]")
        self.weight = weight
        self._bytes = 0.0  # the averages; meaningful once `samples` > 0
        self._seconds = 0.0
        self.samples = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        """L3 read `nbytes` bytes in `seconds` (one fetch's, and the reads' ahead of it);
        nothing read: no sample."""
        if nbytes <= 0 or not math.isfinite(seconds):
            return
        seconds = max(seconds, 1e-6)  # a clock too coarse for a fast read
        if self.samples == 0:
            self._bytes, self._seconds = float(nbytes), seconds
        else:
            w = self.weight
            self._bytes += w * (nbytes - self._bytes)
            self._seconds += w * (seconds - self._seconds)
        self.samples += 1

    def bytes_per_s(self) -> float | None:
        """The recent rate, or None before the first sample."""
        return self._bytes / self._seconds if self.samples else None

    def reset(self) -> None:
        """Forget every sample (another store was attached: its rate is not the old one's)."""
        self._bytes = self._seconds = 0.0
        self.samples = 0
