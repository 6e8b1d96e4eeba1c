"""Who holds an engine's memory: `claim`, the rule by which a pool registration takes the
memory it names (its pool's memfd, or its CUDA allocations, and its counter file) from every
other session's, and the errors that say why not.

A session's ops read and write the memory its registration named until `EngineServer.end`
has settled every one of them (server.py). So memory an unended session still holds is never
handed to another session, this engine's own process included: a worker that timed out on a
store reconnects and registers the same memory again, and takes that registration's success
as the sidecar's word that the old session's copies are over (`integrations/vllm/stores.py`).

Lifecycle of one session's claim (`Session.memory`, `Session.ended`):

    unclaimed --claim()--> claimed            set before the registration's first await,
                                              so a racing claim sees it
    claimed --registration failed--> unclaimed      (ops_pools.py)
    claimed --EngineServer.end--> released    loads cancelled and awaited, the attachment's
                                              ops cancelled and awaited, then
                                              `memory = []` and `ended` set

A claim that meets memory another session holds:
- another process's: REFUSED (a memfd reached through /proc, or another process's CUDA
  allocation): never retried;
- this process's, that session's connection gone (it is ending): wait for its `ended`, up to
  `ENDING_WAIT_S`, then look again from the top (another claim may have won meanwhile); a
  claim whose own connection went meanwhile claims nothing;
- this process's, its connection still open, or its end slower than `ENDING_WAIT_S`: BUSY,
  naming the session, its ops in flight and what to do; the engine retries (a reconnect
  replays the registration).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence

from hicache.channel import protocol as p
from hicache.service.sessions import MemoryId, Session

# A session whose connection is gone ends as soon as its ops settle: milliseconds when none
# is slow. A registration waits that long for it, not longer: an engine's call has its own
# timeout, and a BUSY reply that says why beats a reply that comes too late to be read.
# A constant on purpose, not a config key: it trades a held reply against a retry, never
# safety, and its bound is the engine's timeout, which the sidecar does not know (design.md).
ENDING_WAIT_S = 2.0


def holder(
    sessions: Mapping[int, Session], session: Session, memory: Sequence[MemoryId]
) -> Session | None:
    """The first other unended session that holds any of `memory`."""
    wanted = set(memory)
    for other in sessions.values():
        if other is not session and wanted & set(other.memory):
            return other
    return None


async def claim(
    sessions: Mapping[int, Session],
    session: Session,
    memory: list[MemoryId],
    op: str,
    *,
    heartbeat_timeout_s: float,
    wait_s: float = ENDING_WAIT_S,
) -> None:
    """`session` holds `memory` on return (`session.memory`); refused (`RequestError`) while
    another session does (see the module's rule)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while (other := holder(sessions, session, memory)) is not None:
        if (other.peer_pid, other.peer_start) != (session.peer_pid, session.peer_start):
            # another process's memory reached through a descriptor of this one (opened from
            # /proc): the sidecar would move this session's bytes into its memory
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"{op}: this memory is registered by {other.describe()}; a session "
                "registers memfds its own process created",
            )
        left = deadline - loop.time()
        if not other.connection_gone or left <= 0:
            raise p.RequestError(
                p.ErrorCode.BUSY, busy_message(op, other, wait_s, heartbeat_timeout_s)
            )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(left):
                await other.ended.wait()
        if session.connection_gone:  # its engine gave up meanwhile: claim nothing for it
            raise p.RequestError(
                p.ErrorCode.BUSY, f"{op}: this session's connection is gone; not registered"
            )
    session.memory = memory


def busy_message(op: str, other: Session, wait_s: float, heartbeat_timeout_s: float) -> str:
    requests, loads = other.in_request, other.loads_running()
    head = (
        f"{op}: this memory is still registered by {other.describe()}, which has "
        f"{requests} request(s) in flight and {loads} load(s) running: its copies may still "
        "read or write it, so no other session gets it before that session ended; "
    )
    if other.connection_gone:
        return head + (
            f"its connection is gone and it did not end within {wait_s:g} s; retry the "
            "registration (a reconnect replays it) once its ops settled"
        )
    return head + (
        "its connection is still open: close that client first (a reconnect then replays the "
        f"registration), or retry after its heartbeat timeout ({heartbeat_timeout_s:g} s)"
    )
