"""Worker threads that never keep a process alive: daemons, closed at interpreter exit.

Lifecycle of an owner (a copy backend): it starts its worker as a daemon thread and calls
`register(self)`; its `close()` (the normal path: queued work finishes, the thread is joined)
calls `forget(self)`. An owner still open when the interpreter exits — the engine raised
before `close()`, or never called it — is closed by `close_open_workers`, an `atexit` hook:
queued work still finishes and each thread is joined, but for at most `EXIT_JOIN_S` seconds,
after which the process exits anyway (the daemon thread stops with it).

Why daemon threads plus `atexit`, not the alternatives:
- A non-daemon worker is joined before `atexit` runs, so an engine that raised before
  `close()` waited forever for a thread that waits forever for work: a stuck process that its
  supervisor never restarts (the bug this module fixes).
- `threading._register_atexit` (what `concurrent.futures` uses) runs when the *main thread*
  ends, while the program's other non-daemon threads may still submit copies; `atexit` runs
  after they have all ended, when nothing can use the worker any more.
- A `weakref.finalize` never fires for a live worker: the thread holds its owner.
"""

from __future__ import annotations

import abc
import atexit
import threading
import weakref
from typing import Protocol

EXIT_JOIN_S = 10.0  # per owner; queued copies are bounded by the scheduler's walk slots


class ExitClosable(Protocol):
    def close_for_exit(self, timeout_s: float) -> None:
        """Do what `close()` does, waiting at most `timeout_s` for the worker thread."""


class WorkerOwner(abc.ABC):
    """An owner of one worker thread: `close()` stops it and joins it; `close_for_exit` does
    the same at interpreter exit, waiting at most `timeout_s`. Both go through `_stop`."""

    def close(self) -> None:
        """Accept no more work, let queued work finish, join the worker; idempotent."""
        self._stop(None)

    def close_for_exit(self, timeout_s: float) -> None:
        """`close` at interpreter exit: the join waits at most `timeout_s`."""
        self._stop(timeout_s)

    @abc.abstractmethod
    def _stop(self, timeout_s: float | None) -> None: ...


_open: weakref.WeakSet[ExitClosable] = weakref.WeakSet()
_lock = threading.Lock()


def register(owner: ExitClosable) -> None:
    """`owner` has started a worker thread; close it at exit unless it is closed before."""
    with _lock:
        _open.add(owner)


def forget(owner: ExitClosable) -> None:
    """`owner` is closing (or closed): the exit hook leaves it alone."""
    with _lock:
        _open.discard(owner)


def open_owners() -> list[ExitClosable]:
    with _lock:
        return list(_open)


def close_open_workers(timeout_s: float = EXIT_JOIN_S) -> None:
    """The `atexit` hook: close every owner still open (each on its own; no order needed)."""
    for owner in open_owners():
        owner.close_for_exit(timeout_s)


atexit.register(close_open_workers)
