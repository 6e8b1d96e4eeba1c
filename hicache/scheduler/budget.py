"""`ByteBudget`: bytes in flight, bounded (backpressure, not unbounded growth).

The dispatcher asks `fits(n)` before it takes an op off the queue and `take(n)` when it
launches, so an op that does not fit stays queued (cancellable, expirable, counted). An op
larger than the whole budget is admitted alone, when nothing else is in flight, never never.
"""

from __future__ import annotations


class ByteBudget:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.in_flight_bytes = 0

    def fits(self, nbytes: int) -> bool:
        return self.in_flight_bytes == 0 or self.in_flight_bytes + nbytes <= self.capacity_bytes

    def take(self, nbytes: int) -> None:
        self.in_flight_bytes += nbytes

    def release(self, nbytes: int) -> None:
        self.in_flight_bytes -= nbytes
        if self.in_flight_bytes < 0:
            raise AssertionError("byte budget released more than was taken")
