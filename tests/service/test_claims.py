"""The memory-claim rule (`service/claims.py`) driven by explicit asyncio events: a session's
memory is never handed to another session, this engine's own process included, before that
session ended; every ordering of the three transitions of a reconnect (the old connection
drops, the old session's op settles and the session ends, the new registration arrives) is
played, and after each the rule's answer is checked against what the old session still held.
The same rule against a real sidecar and real copies: `tests/service/test_session_epochs.py`."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import pytest

from hicache.channel import protocol as p
from hicache.service.claims import claim
from hicache.service.sessions import MemoryId, Session

POOL: MemoryId = (1, 100)  # a memfd's (st_dev, st_ino)
COUNTERS_OLD: MemoryId = (1, 200)
COUNTERS_NEW: MemoryId = (1, 201)
HEARTBEAT_S = 30.0

pytestmark = pytest.mark.asyncio


@dataclass
class _Transport:
    """What a session reads of its transport: whether it is closing."""

    closing: bool = False

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


def _session(sid: int, pid: int = 4242, start: int = 7) -> Session:
    session = Session(sid, _Transport(), 0.0, engine="vllm")  # type: ignore[arg-type]
    session.unix, session.peer_pid, session.peer_start = True, pid, start
    return session


def _registered(sid: int, pid: int = 4242, start: int = 7) -> Session:
    session = _session(sid, pid, start)
    session.memory = [POOL, COUNTERS_OLD]
    session.in_request = 1  # a store in flight
    return session


def _drop(session: Session) -> None:
    """Its connection is gone (connection.py: `connection_lost` sets `ending`)."""
    session.transport.close()


def _end(sessions: dict[int, Session], session: Session) -> None:
    """What `EngineServer.end` does once every op of the session settled."""
    session.in_request = 0
    session.memory = []
    sessions.pop(session.id, None)
    session.ended.set()


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _claim(sessions: dict[int, Session], new: Session, wait_s: float = 60.0) -> asyncio.Task[None]:
    sessions[new.id] = new
    return asyncio.ensure_future(
        claim(
            sessions,
            new,
            [POOL, COUNTERS_NEW],
            "register_pools",
            heartbeat_timeout_s=HEARTBEAT_S,
            wait_s=wait_s,
        )
    )


async def test_a_claim_waits_for_the_ending_session_of_its_own_process() -> None:
    """The defect: the same process's new registration succeeded while its old session
    still ran a store from that memory. Now it waits for the old session's end."""
    old = _registered(1)
    sessions = {1: old}
    _drop(old)
    new = _session(2)
    task = _claim(sessions, new)
    await _turns()
    assert not task.done()  # the old store still reads the memory
    assert new.memory == []
    _end(sessions, old)
    await task
    assert new.memory == [POOL, COUNTERS_NEW]


async def test_a_claim_of_memory_a_live_session_holds_is_busy_naming_it() -> None:
    old = _registered(1)
    old.loads[9] = _running_load()
    sessions = {1: old}
    with pytest.raises(p.RequestError) as info:
        await _claim(sessions, _session(2))
    assert info.value.code == p.ErrorCode.BUSY
    assert info.value.message == (
        "register_pools: this memory is still registered by session 1 (vllm pid 4242), which "
        "has 1 request(s) in flight and 1 load(s) running: its copies may still read or write "
        "it, so no other session gets it before that session ended; its connection is still "
        "open: close that client first (a reconnect then replays the registration), or retry "
        "after its heartbeat timeout (30 s)"
    )
    assert old.memory == [POOL, COUNTERS_OLD]


async def test_an_end_slower_than_the_wait_is_busy_and_says_to_retry() -> None:
    old = _registered(1)
    sessions = {1: old}
    _drop(old)
    new = _session(2)
    with pytest.raises(p.RequestError) as info:
        await _claim(sessions, new, wait_s=0.0)
    assert info.value.code == p.ErrorCode.BUSY
    assert info.value.message.endswith(
        "its connection is gone and it did not end within 0 s; retry the registration (a "
        "reconnect replays it) once its ops settled"
    )
    assert new.memory == []


async def test_another_processs_memory_is_refused_for_good() -> None:
    old = _registered(1, pid=999, start=3)
    sessions = {1: old}
    _drop(old)  # even ending: it is not this process's to take
    with pytest.raises(p.RequestError) as info:
        await _claim(sessions, _session(2))
    assert info.value.code == p.ErrorCode.REFUSED
    assert info.value.message == (
        "register_pools: this memory is registered by session 1 (vllm pid 999); a session "
        "registers memfds its own process created"
    )


async def test_a_reused_pid_is_another_process() -> None:
    old = _registered(1, pid=4242, start=3)  # same pid, an earlier process
    with pytest.raises(p.RequestError) as info:
        await _claim({1: old}, _session(2, pid=4242, start=7))
    assert info.value.code == p.ErrorCode.REFUSED


async def test_two_claims_waiting_for_one_end_one_wins_the_other_is_told_why() -> None:
    old = _registered(1)
    sessions = {1: old}
    _drop(old)
    first, second = _session(2), _session(3)
    a, b = _claim(sessions, first), _claim(sessions, second)
    await _turns()
    assert not a.done()
    assert not b.done()
    _end(sessions, old)
    done = await asyncio.gather(a, b, return_exceptions=True)
    errors = [r for r in done if isinstance(r, p.RequestError)]
    assert len(errors) == 1, done
    assert errors[0].code == p.ErrorCode.BUSY
    winner = first if done[0] is None else second
    assert winner.memory == [POOL, COUNTERS_NEW]
    assert (second if winner is first else first).memory == []
    assert f"still registered by session {winner.id} " in errors[0].message


# a session ends only once its connection is gone (its op settled first); the claim may
# come anywhere: the orderings that can happen
ORDERS = [
    order
    for order in itertools.permutations(("drop", "end", "claim"))
    if order.index("drop") < order.index("end")
]


@pytest.mark.parametrize("order", ORDERS)
async def test_every_ordering_of_drop_end_and_claim(order: tuple[str, ...]) -> None:
    """Whatever the order, the new session never holds the memory while the old one does,
    and it gets it exactly when the old one was ending or had ended when it came."""
    old = _registered(1)
    sessions = {1: old}
    new = _session(2)
    task: asyncio.Task[None] | None = None
    for step in order:
        if step == "drop":
            _drop(old)
        elif step == "end":
            _end(sessions, old)
        else:
            task = _claim(sessions, new)
        await _turns()
        assert not (set(new.memory) & set(old.memory)), (order, step)
    assert task is not None
    result = await asyncio.gather(task, return_exceptions=True)
    if order.index("claim") < order.index("drop"):  # arrived while the old one was live
        assert isinstance(result[0], p.RequestError)
        assert result[0].code == p.ErrorCode.BUSY
        assert new.memory == []
    else:
        assert result == [None]
        assert new.memory == [POOL, COUNTERS_NEW]
        assert old.ended.is_set()


def _running_load() -> object:
    class _Handle:
        result = None

    class _Entry:
        handle = _Handle()

    return _Entry()
