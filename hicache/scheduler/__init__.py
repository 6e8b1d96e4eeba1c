"""The asyncio core: ops in, layer walks out. See scheduler.py for the lifecycle."""

from hicache.scheduler.attachments import DEFAULT_ATTACHMENT
from hicache.scheduler.clock import Clock, FakeClock, MonotonicClock
from hicache.scheduler.handle import OpHandle
from hicache.scheduler.moves import MovePolicy, OpRequestError
from hicache.scheduler.ops import GroupOutcome, GroupPages, OpKind, OpResult, OpState
from hicache.scheduler.records import ShutdownReport
from hicache.scheduler.runner import loop_name, run
from hicache.scheduler.scheduler import Scheduler, SchedulerClosedError
from hicache.scheduler.stats import DirectionStats, SchedulerStats

__all__ = [
    "DEFAULT_ATTACHMENT",
    "Clock",
    "DirectionStats",
    "FakeClock",
    "GroupOutcome",
    "GroupPages",
    "MonotonicClock",
    "MovePolicy",
    "OpHandle",
    "OpKind",
    "OpRequestError",
    "OpResult",
    "OpState",
    "Scheduler",
    "SchedulerClosedError",
    "SchedulerStats",
    "ShutdownReport",
    "loop_name",
    "run",
]
