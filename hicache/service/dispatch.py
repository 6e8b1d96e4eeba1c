"""What an engine connection (`connection.py`) needs of the server behind it, and how an op
answers: the `Dispatcher` protocol, the connection's `ConnectionLimits`, and `Later`.

A connection's lifecycle against its dispatcher: `open` (a session, or None: refused, the
transport already told and closed) -> for each frame, in order, `answer_now` while no awaited
reply is pending (bytes: the reply, written at once; a `Deferred`: await it in order), then
`answer` for the frames queued behind it -> `end` once the socket is gone. `dropped` counts a
connection the connection itself closed (an oversized frame, a slow reader).

An op handler returns its result (a dict), answered inline with no task and no await, or a
`Later` (an op that awaits: a lookup L3 may extend, a store, a load) that the dispatcher
awaits in request order. So a lookup L3 cannot extend is answered inside `data_received`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hicache.assembly import ServiceSettings
from hicache.service.sessions import Session

Result = dict[str, Any]  # an op's reply body


@dataclass(frozen=True, slots=True)
class Later:
    """A handler's answer that needs an await; `run` gives the result (or raises)."""

    run: Callable[[], Awaitable[Result]]


Reply = Result | Later
Handler = Callable[[Session, Any], Reply]
Deferred = Callable[[], Awaitable[bytes]]  # a reply frame the connection awaits in order


def awaited(op: Callable[[Session, Any], Awaitable[Result]]) -> Handler:
    """A handler for an op that always awaits (hello, pool registration, store, load,
    prefetch): nothing of it runs before the dispatcher awaits it."""
    return lambda session, args: Later(lambda: op(session, args))


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_frame_bytes: int  # a larger frame closes its connection
    max_unread_reply_bytes: int  # reading pauses past this many unread reply bytes
    max_pipelined_requests: int  # ... or this many requests queued behind an awaited one
    slow_reader_timeout_s: float  # unread that long: the connection is dropped

    @classmethod
    def of(cls, service: ServiceSettings) -> ConnectionLimits:
        return cls(
            service.max_frame_bytes,
            service.max_unread_reply_bytes,
            service.max_pipelined_requests,
            service.slow_reader_timeout_s,
        )


class Dispatcher(Protocol):
    @property
    def limits(self) -> ConnectionLimits: ...

    def open(self, transport: asyncio.Transport) -> Session | None:
        """A session for a new connection; None: refused (the transport told and closed)."""
        ...

    def answer_now(self, session: Session, payload: bytes) -> bytes | Deferred:
        """The reply to one request body, or what to await for it (an op that awaits)."""
        ...

    def answer(self, session: Session, payload: bytes) -> Awaitable[bytes]:
        """The reply to one request body queued behind an awaited one."""
        ...

    def end(self, session: Session, reason: str) -> Awaitable[None]:
        """The connection is gone: end its session (loads cancelled, pools detached)."""
        ...

    def dropped(self, reason: str, *, error_code: str | None = None) -> None:
        """Count a connection the connection closed itself (and the error it sent)."""
        ...
