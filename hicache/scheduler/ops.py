"""Typed records of ops: what a caller asks for (`GroupPages`), the states an op goes through
(`OpState`), and what it reports (`GroupOutcome`, `OpResult`). No sentinels: absent is empty.

States: QUEUED -> RUNNING -> DONE | FAILED | CANCELLED | EXPIRED, or QUEUED -> CANCELLED |
EXPIRED. Every final state has released every pin the op held.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class OpKind(StrEnum):
    LOAD = "load"  # L2 -> L1
    BACKUP = "backup"  # L1 -> L2


class OpState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def final(self) -> bool:
        return self not in (OpState.QUEUED, OpState.RUNNING)


@dataclass(frozen=True, slots=True)
class GroupPages:
    """One group's pages of a prefix, in token order. For a load, `host_pages[i]` holds what
    goes to `device_pages[i]`; for a backup, `host_pages` are pages the caller reserved (it
    keeps them, success or not), or empty: the scheduler allocates them. A load of a state
    group (linear / mamba / conv) carries exactly one page, the snapshot slot; a backup one
    per snapshot.

    `device_pages[i]` is page `first_page + i` of the prompt. `num_tokens` is the prefix
    length the load serves: a sliding or chunked group's load must say it (which pages its
    window or chunk needs depends on it, and guessing whole pages once served a window a page
    short); other groups may leave it None (every page given moves)."""

    device_pages: tuple[int, ...]
    host_pages: tuple[int, ...] = ()
    num_tokens: int | None = None
    first_page: int = 0


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    moved_device_pages: tuple[int, ...] = ()
    host_pages: tuple[int, ...] = ()  # paired with moved_device_pages
    failed_device_pages: tuple[int, ...] = ()
    skipped_device_pages: tuple[int, ...] = ()  # not needed: outside the window, or policy


@dataclass(frozen=True, slots=True)
class OpResult:
    op_id: int
    kind: OpKind
    state: OpState
    groups: Mapping[str, GroupOutcome] = field(default_factory=dict)
    bytes_moved: int = 0
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.state is OpState.DONE
