"""`EngineConnection`: one engine's socket as an `asyncio.Protocol` — frames in, replies out, in
request order (cheap ops inline, awaited ones through an ordered worker); its end ends the
session."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, cast

from hicache.service import protocol as p
from hicache.service.sessions import Session

if TYPE_CHECKING:
    from hicache.service.server import EngineServer


class EngineConnection(asyncio.Protocol):
    """One engine connection: frames in, replies out, in request order. Cheap ops are answered
    inside `data_received` (no task, no await); the first op that must await starts a worker
    task that drains the queue in order, so a later cheap op never overtakes it."""

    def __init__(self, server: EngineServer):
        self.server = server
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.session: Session | None = None
        self.buffer = bytearray()
        self.queue: deque[bytes] = deque()
        self.worker: asyncio.Task[None] | None = None
        self.ended: asyncio.Task[None] | None = None
        self.reason = "closed by engine"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.session = self.server._open(self)
        if self.session is not None:
            self.server._connections.add(self)

    def data_received(self, data: bytes) -> None:
        session = self.session
        if session is None or self.transport.is_closing():
            return
        session.last_seen = time.monotonic()
        buffer = self.buffer
        buffer += data
        header = p.HEADER.size
        limit = self.server.service.max_frame_bytes
        while len(buffer) >= header:
            (size,) = p.HEADER.unpack_from(buffer)
            if size > limit:
                self.transport.write(
                    p.error(
                        0,
                        p.ErrorCode.BAD_FRAME,
                        f"frame of {size} bytes exceeds service.max_frame_bytes ({limit}); "
                        "closing the connection",
                    )
                )
                self.server.metrics.errors.labels(p.ErrorCode.BAD_FRAME).inc()
                self.reason = "oversized frame"
                self.transport.close()
                return
            if len(buffer) < header + size:
                break
            payload = bytes(buffer[header : header + size])
            del buffer[: header + size]
            if self.worker is None:
                reply = self.server.answer_now(session, payload)
                if reply is not None:
                    self.transport.write(reply)
                    continue
            self.queue.append(payload)
            if self.worker is None:
                self.worker = asyncio.ensure_future(self._drain(session))

    async def _drain(self, session: Session) -> None:
        try:
            while self.queue:
                reply = await self.server.answer(session, self.queue.popleft())
                if not self.transport.is_closing():
                    self.transport.write(reply)
        finally:
            self.worker = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.session is None:
            return
        if exc is not None and self.reason == "closed by engine":
            self.reason = "connection lost"
        self.ended = asyncio.ensure_future(self._end())

    async def _end(self) -> None:
        assert self.session is not None
        if self.worker is not None:  # let the op in hand finish before its pools go away
            await asyncio.gather(self.worker, return_exceptions=True)
        self.queue.clear()
        try:
            await self.server._end_session(self.session, self.reason)
        finally:
            self.server._connections.discard(self)
