"""The engine's side of the sidecar: `connect(address, ...)` -> `Client` (blocking) or
`await connect_async(...)` -> `AsyncClient`; both mirror the embedded API.

Lifecycle:
    client = connect(".hicache/engine.sock", layer_map, dtype="bfloat16", page_size_tokens=16)
    pools = client.create_pools(num_pages=64)    # KV pool in a sealed memfd; compute with
    client.register_pools(pools)                 # pools.device_pools()[group].tensors
    hit = client.lookup(tokens)
    keys = client.page_keys(tokens)              # or: keyed once here, as the sidecar keys
    hit = client.lookup_keys(keys)               # them; lookup_many([keys, ...]) in one frame
    client.store(tokens, device_pages)           # after prefill wrote those pages
    handle = client.load(tokens, device_pages)   # None when nothing hits
    for layer_id in layers: handle.wait_layer(layer_id); ...   # reads shared memory
    handle.done()                                # final state; frees the load's slot
    client.close()                               # also closes the pool's memfd

`address` is a Unix socket path (a `Path`, or a string with a '/', or with neither '/' nor
':'), or TCP as `tcp://host:port` or `host:port`; anything else is refused (`ConfigError`)
saying how to write each (`parse_address`). No sidecar there: `SidecarUnreachableError`
(a `ConnectionError`) naming the address tried and why (no such file, connection refused,
permission denied, timed out).

A heartbeat thread (task, for the async client) keeps the session alive and carries the
engine's per-layer stall times to the sidecar's metrics. It is a daemon (`hicache-heartbeat`)
and holds nothing that must be finished, so an engine that raises before `close()` still
exits; the sidecar then sees the session end (or its heartbeats stop) and drops its mappings
of the pool (a memfd: its memory goes with the last descriptor and mapping, no file is left).
`close()` stops it and joins it. The async client's task is cancelled with its loop
(`asyncio.run` cancels what is left).

When the connection drops, the next call reconnects once, says hello and re-registers the
same pools (loads in flight on the old connection fail with `LoadLostError`), then retries
the call. A request with no reply in time raises `NoReplyError` naming the session (epoch)
it was sent in, and drops the connection (a late reply is never read as another's). The
sidecar registers the same pools again only once that session ended, every copy of it
settled (a wait of up to 2 s, else a `busy` refusal to retry): once `client.confirmed(epoch)`
the engine may reuse the pages that request named.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache.assembly import client_settings
from hicache.channel import protocol as p
from hicache.channel.shm import SharedPools
from hicache.client.base import (
    ClientBase,
    load_args,
    page_lists,
    page_lists_held,
    parse_address,
    store_args,
    unreachable,
)
from hicache.client.handle import ClientError, LoadHandle, Lookup, NoReplyError
from hicache.client.keys import PromptKeys
from hicache.config import LoadedConfig
from hicache.index import Served
from hicache.memory import DevicePool
from hicache.model import LayerMap


class Client(ClientBase):
    """Blocking client; thread-safe (one request at a time on the socket)."""

    def __init__(
        self,
        address: str | Path,
        layer_map: LayerMap,
        *,
        dtype: str = "bfloat16",
        page_size_tokens: int = 16,
        tp_rank: int = 0,
        tenant: str = "",
        token: str | None = None,
        engine: str = "",
        timeout_s: float = 30.0,
        heartbeat: bool = True,
        reconnect: bool = True,
        state_dtype: str | None = None,
        ssm_state_dtype: str | None = None,
        role: str = "engine",
        tp_size: int | None = None,
    ):
        super().__init__(
            layer_map,
            dtype,
            page_size_tokens,
            tp_rank,
            tenant,
            token,
            engine,
            state_dtype=state_dtype,
            ssm_state_dtype=ssm_state_dtype,
            role=role,
            tp_size=tp_size,
        )
        self.address = address
        self.timeout_s = timeout_s
        self.reconnect = reconnect
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = threading.Event()
        self._connect()
        self._beat: threading.Thread | None = None
        if heartbeat:
            self._beat = threading.Thread(
                target=self._heartbeats, name="hicache-heartbeat", daemon=True
            )
            self._beat.start()

    # ---- transport ------------------------------------------------------------------------

    def _connect(self) -> None:
        family, addr = parse_address(self.address)
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            try:
                sock.connect(addr)
            except OSError as exc:
                raise unreachable(family, addr, exc, self.timeout_s) from exc
            self._sock = sock
            self._note_peer(sock)
            self.session = self._exchange("hello", self._hello)
            if self._registration is not None:
                self._pools_registered(self._exchange(*self._registration_args()))
        except BaseException:
            # a refused hello or re-registration: the next call starts afresh, it never
            # talks on a session that said no
            sock.close()
            self._sock = None
            raise

    def _recv_exact(self, n: int) -> bytes:
        assert self._sock is not None
        chunks, got = [], 0
        while got < n:
            chunk = self._sock.recv(n - got)
            if not chunk:
                raise ConnectionResetError("the sidecar closed the connection")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _exchange(self, op: str, args: Mapping[str, Any]) -> dict[str, Any]:
        assert self._sock is not None
        request_id, data = self._request(op, args)
        self._sock.sendall(data)
        # one recv holds a small reply whole (header and body): one syscall, not two
        first = self._sock.recv(65536)
        if len(first) < p.HEADER.size:
            if not first:
                raise ConnectionResetError("the sidecar closed the connection")
            first += self._recv_exact(p.HEADER.size - len(first))
        (size,) = p.HEADER.unpack_from(first)
        body = first[p.HEADER.size :]
        if len(body) < size:
            body += self._recv_exact(size - len(body))
        return self._check_epoch(op, self._result(request_id, p.unpack(body)))

    def call(self, op: str, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
        with self._lock:
            if self._closed.is_set():
                raise ClientError("closed", "the client is closed")
            try:
                return self._call_once(op, args or {})
            except OSError as exc:  # the connection broke (no reply in time is not retried)
                if isinstance(exc, TimeoutError) or not self.reconnect:
                    raise
                return self._call_once(op, args or {})

    def _call_once(self, op: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """One try on the connection (made first when there is none). Any failure of the
        socket drops it: a late reply is never read as the next request's. No reply in time:
        `NoReplyError` with the epoch the request may still run in."""
        try:
            if self._sock is None:
                self._connect()
            return self._exchange(op, args)
        except TimeoutError as exc:
            epoch = self.now()
            self._drop_socket()
            if isinstance(exc, NoReplyError):
                raise
            raise NoReplyError(op, epoch, self.timeout_s) from exc
        except OSError:
            self._drop_socket()
            raise

    def _drop_socket(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def _heartbeats(self) -> None:
        interval = max(0.05, float(self.session.get("heartbeat_timeout_s", 30.0)) / 3)
        while not self._closed.wait(interval):
            try:
                self.call("heartbeat", self._heartbeat_args())
            except Exception:  # the next call reconnects or reports; nothing to do here
                continue

    # ---- the API ---------------------------------------------------------------------------

    def register_pools(self, pools: SharedPools) -> None:
        """Share a pool made by `create_pools` (the CPU data plane)."""
        self.pools = pools
        registration = ("register_pools", pools.manifest())
        self._pools_registered(self.call(*self._registration_args(registration)))
        self._registration = registration

    def register_cuda_pools(self, pools: Mapping[str, DevicePool]) -> None:
        """Share the engine's CUDA pools by IPC handle (a sidecar with device.kind: cuda); keep
        the tensors alive while registered."""
        from hicache.transfer.cuda_ipc import export_cuda_pools, pools_device

        # exported once per pool: a retried registration and a reconnect reuse it (cuda_ipc)
        registration = ("register_cuda_pools", export_cuda_pools(pools))
        self.cuda_device = pools_device(pools)
        self._pools_registered(self.call(*self._registration_args(registration)))
        self._registration = registration

    def lookup(self, tokens: Sequence[int]) -> Lookup:
        return self._lookup_of(self.call("lookup", {"tokens": list(tokens)}))

    def lookup_keys(
        self,
        keys: PromptKeys | Sequence[int],
        groups: Sequence[str] | None = None,
        *,
        wait_stored_s: float = 0.0,
        answer_at_once: bool = False,
    ) -> Lookup:
        """`lookup` by the prompt's page keys (`page_keys`, computed once per prompt; tokens
        are keyed here first): the same answer, without the sidecar decoding and hashing a
        token list. `groups`: the hit of those groups alone (an engine that moves each of its
        pools on its own). `wait_stored_s`: when the hit stops at a page another engine's
        store is writing now, the sidecar answers once that store ended, or after this long
        (the call's reply timeout must exceed it); `Lookup.store_wait` says how it ended.
        `answer_at_once` (with `wait_stored_s`): never held; `Lookup.store_writing` says a
        store is writing the next page, and the engine asks again later itself (a sidecar
        that predates it refuses the field by name)."""
        args = self._key_lookup_args(keys, wait_stored_s, answer_at_once)
        if groups is not None:
            args["groups"] = list(groups)
        return self._lookup_of(self.call("lookup_keys", args))

    def served_keys(
        self, keys: PromptKeys, groups: Sequence[str] | None = None
    ) -> dict[str, Served]:
        """Per group (of `groups`; None: all), the prefix lengths in pages it alone can serve
        from the sidecar's L2 or L3: a whole-prefix group every length up to its `run`, a
        state group those in `at` (where a snapshot is stored); `Served.lengths(n)` lists
        them."""
        args = self._key_args(keys) | {"served": True}
        if groups is not None:
            args["groups"] = list(groups)
        reply = self.call("lookup_keys", args)
        return {
            group: Served(int(got["run"]), tuple(int(h) for h in got["at"]))
            for group, got in reply["served"].items()
        }

    def lookup_many(self, prompts: Sequence[PromptKeys | Sequence[int]]) -> list[Lookup]:
        """Several prompts' `lookup_keys` in one frame (more than fit go in a few), answered
        in order."""
        out = []
        for batch in self._lookup_batches(prompts):
            reply = self.call("lookup_many", {"lookups": batch})
            out += [self._lookup_of(r) for r in reply["results"]]
        return out

    def store(
        self,
        tokens: Sequence[int],
        device_pages: Mapping[str, Sequence[int | None]],
        snapshots: Mapping[str, Mapping[int, int]] | None = None,
        *,
        stream: Any = None,
        fence: tuple[Any, bytes | None] | None = None,
        persisted_within_s: float = 0.0,
    ) -> dict[str, Any]:
        """Back up the prompt's pages the sidecar lacks. Token groups: a device page per full
        page in token order, None where the engine no longer holds it (freed out-of-window
        pages). State groups: `snapshots[group] = {num_tokens: slot}`, the state after exactly
        num_tokens tokens (a multiple of the page size), one per boundary kept.

        Ordering. Shared-memory pools: the pages must be written before this call (the
        sidecar reads them once the request arrives). CUDA pools: the sidecar's backup waits,
        on the GPU, for the work queued so far on `stream` (default: the calling thread's
        current stream on the pools' device): an interprocess event is recorded there and
        its handle sent with the request, so the engine need not synchronise — but every
        kernel that wrote these pages must be on that stream, or ordered before it (e.g.
        `stream.wait_stream(other)`), at the time of this call. `fence`: one recorded
        earlier (`record_fence`, on the engine's thread) for a store sent from another
        thread; then no `stream`. `persisted_within_s`: the reply waits until L3 holds the
        prompt's pages, at most this long (its `persisted` says whether it does); the
        call's reply timeout must exceed it."""
        if fence is not None and stream is not None:
            raise ClientError(
                p.ErrorCode.BAD_REQUEST,
                "store: give a stream or a recorded fence (record_fence(stream)), not both",
            )
        # this thread, before the request, unless recorded earlier where the pages were written
        event, handle = fence if fence is not None else self._engine_fence(stream, "store")
        try:
            args = store_args(tokens, device_pages, snapshots, handle)
            if persisted_within_s > 0:  # only then: an older sidecar is asked as before
                args["persisted_within_s"] = float(persisted_within_s)
            return self.call("store", args)
        except BaseException as exc:
            self._keep_fence(event, exc)  # no reply: alive until confirmed (_engine_fence)
            raise

    def load(
        self,
        tokens: Sequence[int],
        device_pages: Mapping[str, Sequence[int]],
        skip_pages: int = 0,
        *,
        stream: Any = None,
    ) -> LoadHandle | None:
        """Load the prompt's hit into `device_pages` (per group, in token order; one snapshot
        page for a state group). `skip_pages`: the first pages are on the device already.
        CUDA pools: the copies run after the work queued so far on `stream` (default: this
        thread's current stream), e.g. an earlier use of those pages, or their zeroing."""
        event, fence = self._engine_fence(stream, "load")  # this thread, before the request
        try:
            reply = self.call("load", load_args(tokens, device_pages, skip_pages, fence))
        except BaseException as exc:
            self._keep_fence(event, exc)  # no reply: alive until confirmed (_engine_fence)
            raise
        return self._handle(reply, self.release, event)  # alive until the load ended

    def store_keys(
        self,
        keys: PromptKeys,
        device_pages: Mapping[str, Sequence[int | None]],
        snapshots: Mapping[str, Mapping[int, int]] | None = None,
        *,
        stream: Any = None,
        persisted_within_s: float = 0.0,
    ) -> dict[str, Any]:
        """`store` of a prompt given by page keys (`key_spec().of_ids(...)`: pages the engine
        names itself) instead of tokens: token groups a device page per key (None: not
        stored), state groups `{num_tokens: slot}` as `store`'s (the state after the keys
        covering num_tokens, filed under the last of them). CUDA pools: ordered after
        `stream`'s work as `store` is (a fence sent with the request).
        `persisted_within_s` > 0: answered once L3 holds the pages stored, or after that
        long (the reply's `persisted` says which), as `store`'s; the call's reply timeout
        must exceed it."""
        args = self._key_args(keys)
        event, handle = self._engine_fence(stream, "store_keys")  # this thread, first
        extra: dict[str, Any] = {} if handle is None else {"fence": handle}
        if persisted_within_s > 0:  # only then: an older sidecar is asked as before
            extra["persisted_within_s"] = float(persisted_within_s)
        if snapshots:
            extra["snapshots"] = {
                group: [[int(n), int(slot)] for n, slot in sorted(given.items())]
                for group, given in snapshots.items()
            }
        try:
            return self.call(
                "store_keys",
                {**extra, "keys": args["keys"], "device_pages": page_lists_held(device_pages)},
            )
        except BaseException as exc:
            self._keep_fence(event, exc)  # no reply: alive until confirmed (_engine_fence)
            raise

    def load_keys(
        self,
        keys: PromptKeys,
        device_pages: Mapping[str, Sequence[int]],
        skip_pages: int = 0,
        *,
        stream: Any = None,
        groups: Sequence[str] | None = None,
        l3_wait_s: float | None = None,
    ) -> LoadHandle | None:
        """`load` of a prompt given by page keys (see `store_keys`); `groups`: the hit and
        copies of those groups alone, `device_pages` naming only them. CUDA pools: the copies
        run after `stream`'s work, as `load`'s do. `l3_wait_s`: how long the sidecar waits
        for the hit's L3-only pages before it copies (None: its prefetch policy's wait);
        the call's reply timeout must exceed it."""
        args = self._key_args(keys)
        event, handle = self._engine_fence(stream, "load_keys")  # this thread, first
        extra: dict[str, Any] = {} if handle is None else {"fence": handle}
        if groups is not None:
            extra["groups"] = list(groups)
        if l3_wait_s is not None:  # only then: an older sidecar is asked as before
            extra["l3_wait_s"] = float(l3_wait_s)
        try:
            reply = self.call(
                "load_keys",
                {
                    **extra,
                    "keys": args["keys"],
                    "device_pages": page_lists(device_pages),
                    "skip_pages": skip_pages,
                },
            )
        except BaseException as exc:
            self._keep_fence(event, exc)  # no reply: alive until confirmed (_engine_fence)
            raise
        return self._handle(reply, self.release, event)  # alive until the load ended

    def prefetch(self, tokens: Sequence[int]) -> int:
        return int(self.call("prefetch", {"tokens": list(tokens)})["pages_fetched"])

    def release(self, load_id: int) -> None:
        try:
            self.call("release", {"load_id": load_id})
        except ClientError as exc:
            if exc.code != p.ErrorCode.OUT_OF_RANGE:  # already gone with its connection
                raise

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def close(self) -> None:
        if self._closed.is_set():
            return
        with self._lock:
            self._closed.set()
            self._drop_socket()
        if self._beat is not None:
            self._beat.join(timeout=5)
        if self.pools is not None:
            self.pools.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(address: str | Path, layer_map: LayerMap, **kwargs: Any) -> Client:
    """A blocking client; `address` is a Unix socket path, or `tcp://host:port` (or
    `host:port`) for TCP (`parse_address`). No sidecar there: `SidecarUnreachableError`
    naming the address and why."""
    return Client(address, layer_map, **kwargs)


def connect_deployment(loaded: LoadedConfig, **kwargs: Any) -> Client:
    """A blocking client for the model a deployment file describes, as the sidecar serving it
    expects: its socket (`service.socket_path`), its layer map (one rank's share at
    `model.tp_size`), dtypes, page size and token. Keywords override or add (`address`,
    `tp_rank`, `tenant`, `engine`, ...)."""
    settings = client_settings(loaded.deployment) | kwargs
    return Client(settings.pop("address"), loaded.layer_map(), **settings)
