"""`ZmqEventPublisher`: the sidecar's KV events on a ZMQ PUB socket, in vLLM 0.32's wire
format (`vllm/distributed/kv_events.py`), so an unmodified KV-aware router subscribes to the
sidecar as it would to an engine: multipart frames `(topic, seq, payload)`, `seq` an 8-byte
big-endian batch number counting from 0, `payload` a msgpack `EventBatch` — an array
`[ts, events]` whose events are tagged maps `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` with their `medium`. A subscriber that sees a gap in `seq` has lost
batches (a slow one, past the socket's high-water mark, as with vLLM's PUB); with a replay
endpoint (`replay_endpoint`, as vLLM's publisher offers) it asks for them again: the last
`buffer_steps` batches are kept, a request is one frame (after the DEALER's empty delimiter)
holding the first wanted seq as 8 big-endian bytes, and the reply is every kept batch from
there as `(topic, seq, payload)` — a batch the PUB socket refused included — then the end
marker `("", seq -1, "")`. Requests are served on the publisher thread between batches (at
most `_SUBSCRIPTION_POLL_S` late when idle); a malformed one is counted and ignored.
The socket is an XPUB (a PUB to subscribers) so the thread also sees subscriptions come and
go: `stats().subscriptions`, how many (subscriber, topic) pairs there are now.

Lifecycle: built (the sockets bound, their errors raised to the caller) -> the publisher thread
runs -> `submit` from the event loop hands it one batch of events without blocking: the queue
between them is bounded (`queue_depth` batches) and a batch that finds it full is dropped and
counted -> `close` lets the thread send what is queued, then stops it and closes the socket.
Sends are `NOBLOCK`: a subscriber that does not read never holds the thread (ZMQ's PUB drops
what exceeds a subscriber's high-water mark; a send it refuses is counted as dropped).
pyzmq and msgspec are the `events` extra; `load_publisher_deps` names it when they are
missing."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from hicache.errors import ConfigError

log = logging.getLogger("hicache.service")

# how often an idle publisher thread reads subscriptions (a send reads them too)
_SUBSCRIPTION_POLL_S = 0.05
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last frame, as vLLM's
Event = tuple[Any, ...]  # ("stored", medium, hashes, parent, tokens, block_size) | ...


def load_publisher_deps() -> tuple[Any, Any]:
    """(zmq, msgspec), or a ConfigError naming the extra that brings them."""
    try:
        import msgspec
        import zmq
    except ImportError as exc:
        raise ConfigError(
            f"service.kv_events needs pyzmq and msgspec ({exc.name} is not installed); "
            "install the events extra (pip install 'hicache[events]') or leave "
            "service.kv_events out"
        ) from None
    return zmq, msgspec


def _wire_types(msgspec: Any) -> dict[str, Any]:
    """vLLM's event structs, field for field (names, order, tags, defaults omitted)."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[misc,call-arg]
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[misc,call-arg]
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return {
        "batch": EventBatch,
        "stored": BlockStored,
        "removed": BlockRemoved,
        "cleared": AllBlocksCleared,
    }


@dataclass(frozen=True, slots=True)
class PublisherStats:
    batches_sent: int
    events_sent: int
    batches_dropped: int  # the queue was full, or the socket refused the send
    events_dropped: int
    queued_batches: int
    subscriptions: int  # (subscriber, topic) pairs now
    replays: int = 0  # replay requests served
    replays_malformed: int = 0  # replay requests ignored (not one 8-byte start seq)


class ZmqEventPublisher:
    def __init__(
        self,
        endpoint: str,
        topic: str,
        queue_depth: int,
        hwm: int,
        *,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
    ):
        zmq, msgspec = load_publisher_deps()
        self._zmq = zmq
        self._types = _wire_types(msgspec)
        self._encoder = msgspec.msgpack.Encoder()
        self._context = zmq.Context()
        # XPUB: a PUB that also hands us subscriptions, so `stats` can say how many topics
        # subscribers hold (a test or operator waits for a router to be listening)
        self._socket = self._context.socket(zmq.XPUB)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        # every subscribe and unsubscribe comes up (not only a topic's first and last): the
        # count is of subscribers' topics, a peer's going unsubscribes its own
        self._socket.setsockopt(zmq.XPUB_VERBOSER, 1)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            self._context.term()
            raise ConfigError(
                f"service.kv_events.endpoint {endpoint!r}: cannot bind ({exc.strerror}); "
                "allowed: a free tcp://host:port or ipc:// path"
            ) from None
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._bind_replay(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._replays = [0, 0]  # served, malformed
        self._topic = topic.encode()
        self._queue: queue.Queue[list[Event] | None] = queue.Queue(maxsize=queue_depth)
        self._lock = threading.Lock()  # the counters, written by both threads
        self._seq = 0
        self._sent = [0, 0]
        self._dropped = [0, 0]
        self._closed = False
        self._subscriptions = 0
        self._thread = threading.Thread(target=self._run, name="hicache-kv-events", daemon=True)
        self._thread.start()

    def _bind_replay(self, replay_endpoint: str) -> Any:
        zmq = self._zmq
        replay = self._context.socket(zmq.ROUTER)
        replay.setsockopt(zmq.LINGER, 0)
        try:
            replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            replay.close(linger=0)
            self._socket.close(linger=0)
            self._context.term()
            raise ConfigError(
                f"service.kv_events.replay_endpoint {replay_endpoint!r}: cannot bind "
                f"({exc.strerror}); allowed: a free tcp://host:port or ipc:// path other "
                "than service.kv_events.endpoint"
            ) from None
        return replay

    def submit(self, events: list[Event]) -> bool:
        """Queue one batch (never blocks); False (counted) when the queue is full."""
        if self._closed:
            return False
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            with self._lock:
                self._dropped[0] += 1
                self._dropped[1] += len(events)
            return False
        return True

    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(
                self._sent[0],
                self._sent[1],
                self._dropped[0],
                self._dropped[1],
                self._queue.qsize(),
                self._subscriptions,
                self._replays[0],
                self._replays[1],
            )

    def encode(self, events: list[Event], ts: float) -> bytes:
        t = self._types
        wire: list[Any] = []
        for event in events:
            if event[0] == "stored":
                _, medium, hashes, parent, tokens, block_size = event
                wire.append(t["stored"](hashes, parent, tokens, block_size, None, medium, None))
            elif event[0] == "removed":
                wire.append(t["removed"](event[2], event[1]))
            else:
                wire.append(t["cleared"]())
        payload: bytes = self._encoder.encode(t["batch"](ts, wire))
        return payload

    def _run(self) -> None:
        zmq = self._zmq
        while True:
            self._read_subscriptions()
            self._serve_replays()
            try:
                events = self._queue.get(timeout=_SUBSCRIPTION_POLL_S)
            except queue.Empty:
                continue
            if events is None:
                break
            seq, self._seq = self._seq, self._seq + 1  # a dropped send leaves a gap in seq
            try:
                frames = (self._topic, seq.to_bytes(8, "big"), self.encode(events, time.time()))
                if self._replay is not None:  # kept even if the send is refused
                    self._buffer.append((seq, frames[2]))
                self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
                done = self._sent
            except zmq.Again:
                done = self._dropped
            except Exception:  # the thread outlives a bad batch: it is counted, logged
                log.exception("kv events: a batch of %d events could not be sent", len(events))
                done = self._dropped
            with self._lock:
                done[0] += 1
                done[1] += len(events)
        self._socket.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    def _serve_replays(self) -> None:
        """Answer every waiting replay request: the kept batches from its start seq, then
        the end marker (a ROUTER drops what a peer past its high-water mark cannot take)."""
        if self._replay is None:
            return
        zmq = self._zmq
        while True:
            try:
                request = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            peer = request[0]
            if len(request) != 3 or len(request[2]) != 8:
                with self._lock:
                    self._replays[1] += 1
                log.warning("kv events: a replay request that is not one 8-byte seq ignored")
                continue
            start = int.from_bytes(request[2], "big")
            with self._lock:  # counted before its end marker goes (a peer may then ask)
                self._replays[0] += 1
            try:
                for seq, payload in self._buffer:
                    if seq >= start:
                        frames = (peer, b"", self._topic, seq.to_bytes(8, "big"), payload)
                        self._replay.send_multipart(frames, flags=zmq.NOBLOCK)
                self._replay.send_multipart((peer, b"", b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # the peer went, or cannot take more: its reply ends short
                log.warning("kv events: a replay to a peer that cannot take it cut short")

    def _read_subscriptions(self) -> None:
        zmq = self._zmq
        while True:
            try:
                message = self._socket.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if message[:1] in (b"\x00", b"\x01"):
                with self._lock:
                    self._subscriptions += 1 if message[0] else -1

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the socket."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)  # the thread drains the queue, so this waits for room at most
        self._thread.join()
