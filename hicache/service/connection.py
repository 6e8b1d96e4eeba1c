"""`EngineConnection`: one engine's socket as an `asyncio.Protocol` — frames in, replies out, in
request order (cheap ops inline, awaited ones through an ordered worker); its end ends the
session. It talks to the server only through the `Dispatcher` protocol (dispatch.py): open,
answer now or later, end, limits, counted drops.

Back-pressure, per connection: the sidecar stops reading a connection whose unread replies pass
`service.max_unread_reply_bytes` (the transport's high-water mark) or whose queue behind an
awaited op reaches `service.max_pipelined_requests`, and reads on once the engine has read
(or the queue drained): an engine that pipelines without reading fills its own socket buffers,
not the sidecar's memory. One that stays unread for `service.slow_reader_timeout_s` is dropped
and counted (`hicache_connections_dropped_total{reason="slow_reader"}`)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from functools import partial
from typing import cast

from hicache.channel import protocol as p
from hicache.service.dispatch import Deferred, Dispatcher
from hicache.service.sessions import Session


class EngineConnection(asyncio.Protocol):
    """One engine connection: frames in, replies out, in request order. Cheap ops are answered
    inside `data_received` (no task, no await); the first op that must await starts a worker
    task that drains the queue in order, so a later cheap op never overtakes it."""

    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher
        self.limits = dispatcher.limits
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.session: Session | None = None
        self.buffer = bytearray()
        self.queue: deque[Deferred] = deque()  # replies to await, in request order
        self.worker: asyncio.Task[None] | None = None
        self.reason = "closed by engine"
        self._unread = False  # replies past the high-water mark: the engine is not reading
        self._reading = True
        self._slow: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        high = self.limits.max_unread_reply_bytes
        self.transport.set_write_buffer_limits(high=high, low=high // 4)
        self.session = self.dispatcher.open(self.transport)

    def data_received(self, data: bytes) -> None:
        if self.session is None or self.transport.is_closing():
            return
        self.session.last_seen = time.monotonic()
        self.buffer += data
        self._process()

    def _process(self) -> None:
        """Answer or queue the complete frames in the buffer, while back-pressure allows."""
        session = self.session
        assert session is not None
        buffer = self.buffer
        header = p.HEADER.size
        limit = self.limits.max_frame_bytes
        while len(buffer) >= header and not self._held():
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
                self.dispatcher.dropped("oversized_frame", error_code=p.ErrorCode.BAD_FRAME)
                self.reason = "oversized frame"
                self.transport.close()
                return
            if len(buffer) < header + size:
                break
            payload = bytes(buffer[header : header + size])
            del buffer[: header + size]
            if self.worker is not None:  # behind an awaited reply: answered in turn
                self.queue.append(partial(self.dispatcher.answer, session, payload))
                continue
            answer = self.dispatcher.answer_now(session, payload)
            if isinstance(answer, bytes):
                self.transport.write(answer)
                continue
            self.queue.append(answer)
            self.worker = asyncio.ensure_future(self._drain())
        self._set_reading(not self._held())

    def _held(self) -> bool:
        return self._unread or len(self.queue) >= self.limits.max_pipelined_requests

    def _set_reading(self, reading: bool) -> None:
        if reading != self._reading and not self.transport.is_closing():
            self._reading = reading
            if reading:
                self.transport.resume_reading()
            else:
                self.transport.pause_reading()

    def pause_writing(self) -> None:
        """The transport's unread replies passed the high-water mark."""
        self._unread = True
        self._set_reading(False)
        timeout = self.limits.slow_reader_timeout_s
        loop = asyncio.get_running_loop()
        self._slow = loop.call_later(timeout, self._drop_slow_reader, timeout)

    def resume_writing(self) -> None:
        self._unread = False
        if self._slow is not None:
            self._slow.cancel()
            self._slow = None
        if self.session is not None and not self.transport.is_closing():
            self._process()

    def _drop_slow_reader(self, timeout: float) -> None:
        if not self._unread or self.transport.is_closing():
            return
        unread = self.transport.get_write_buffer_size()
        self.reason = f"slow reader: {unread} reply bytes unread for {timeout:g} s"
        self.dispatcher.dropped("slow_reader")
        self.transport.abort()  # connection_lost ends the session

    async def _drain(self) -> None:
        try:
            while self.queue and not self.transport.is_closing():  # no one reads the rest
                reply = await self.queue.popleft()()
                if not self.transport.is_closing():
                    self.transport.write(reply)
        finally:
            self.worker = None
        if not self.transport.is_closing():
            self._process()  # frames held back while the queue was full

    def connection_lost(self, exc: Exception | None) -> None:
        if self._slow is not None:
            self._slow.cancel()
        if self.session is None:
            return
        if exc is not None and self.reason == "closed by engine":
            self.reason = "connection lost"
        self.session.lost(asyncio.ensure_future(self._end()))

    async def _end(self) -> None:
        assert self.session is not None
        if self.worker is not None:  # let the op in hand finish before its pools go away
            await asyncio.gather(self.worker, return_exceptions=True)
        self.queue.clear()
        await self.dispatcher.end(self.session, self.reason)
