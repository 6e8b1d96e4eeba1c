"""`AsyncClient` / `connect_async`: the engine client on asyncio (an engine whose scheduler is a
coroutine), with the blocking client's API and reconnect; heartbeats run as a task."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache.channel import protocol as p
from hicache.channel.shm import SharedPools
from hicache.client.base import (
    ClientBase,
    load_args,
    parse_address,
    store_args,
    unreachable,
)
from hicache.client.handle import ClientError, Epoch, LoadHandle, Lookup, NoReplyError
from hicache.client.keys import PromptKeys
from hicache.memory import DevicePool
from hicache.model import LayerMap


class AsyncClient(ClientBase):
    """The same API on asyncio (an engine whose scheduler is a coroutine); `LoadHandle`'s
    `wait_layer` stays synchronous: the forward pass calls it from its own thread."""

    def __init__(self, address: str | Path, layer_map: LayerMap, **kwargs: Any):
        self.address = address
        self.reconnect = kwargs.pop("reconnect", True)
        self.timeout_s = kwargs.pop("timeout_s", 30.0)
        self._heartbeat_enabled = kwargs.pop("heartbeat", True)
        super().__init__(
            layer_map,
            kwargs.pop("dtype", "bfloat16"),
            kwargs.pop("page_size_tokens", 16),
            kwargs.pop("tp_rank", 0),
            kwargs.pop("tenant", ""),
            kwargs.pop("token", None),
            kwargs.pop("engine", ""),
            state_dtype=kwargs.pop("state_dtype", None),
            ssm_state_dtype=kwargs.pop("ssm_state_dtype", None),
            role=kwargs.pop("role", "engine"),
            tp_size=kwargs.pop("tp_size", None),
        )
        if kwargs:
            raise TypeError(f"unknown arguments {sorted(kwargs)}")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()
        self._beat: asyncio.Task[None] | None = None
        self._closed = False
        # the session a call cancelled while its request was out ran in: its op may still
        # read or write this engine's memory until `confirmed(cancelled_in)`
        self.cancelled_in: Epoch | None = None

    async def _connect(self) -> None:
        family, addr = parse_address(self.address)
        try:
            async with asyncio.timeout(self.timeout_s):
                if family == socket.AF_UNIX:
                    self._reader, self._writer = await asyncio.open_unix_connection(addr)
                else:
                    self._reader, self._writer = await asyncio.open_connection(*addr)
        except OSError as exc:  # TimeoutError among them
            raise unreachable(family, addr, exc, self.timeout_s) from exc
        if self._closed:  # close() came while connecting: no session is opened after it
            self._drop()
            raise ClientError("closed", "the client is closed")
        sock = self._writer.get_extra_info("socket")
        if sock is not None:
            self._note_peer(sock)
        try:
            self.session = await self._exchange("hello", self._hello)
            if self._registration is not None:
                self._pools_registered(await self._exchange(*self._registration_args()))
        except BaseException:
            # a refused hello or re-registration: the next call starts afresh, it never
            # talks on a session that said no
            self._drop()
            raise

    async def _exchange(self, op: str, args: Mapping[str, Any]) -> dict[str, Any]:
        assert self._reader is not None
        assert self._writer is not None
        request_id, data = self._request(op, args)
        self._writer.write(data)
        await self._writer.drain()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the result and drops
        # a cancel that lands in the step the reply arrives, and the cancelled task lives on
        async with asyncio.timeout(self.timeout_s):
            header = await self._reader.readexactly(p.HEADER.size)
        (size,) = p.HEADER.unpack(header)
        async with asyncio.timeout(self.timeout_s):
            payload = await self._reader.readexactly(size)
        return self._check_epoch(op, self._result(request_id, p.unpack(payload)))

    async def call(self, op: str, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
        async with self._lock:
            if self._closed:
                raise ClientError("closed", "the client is closed")
            try:
                return await self._call_once(op, args or {})
            except (ConnectionError, asyncio.IncompleteReadError):
                if not self.reconnect:
                    raise
                return await self._call_once(op, args or {})

    async def _call_once(self, op: str, args: Mapping[str, Any]) -> dict[str, Any]:
        """`Client._call_once` on asyncio: any failure drops the connection; no reply in
        time raises `NoReplyError` with the epoch the request may still run in. A cancel
        drops it too (its reply, or half of it, would be read as the next request's; the
        sidecar ends the session and its ops) and records that epoch in `cancelled_in`."""
        try:
            if self._writer is None:
                if self._closed:  # close() came while a call waited: never reconnect
                    raise ClientError("closed", "the client is closed")
                await self._connect()
            return await self._exchange(op, args)
        except asyncio.CancelledError:
            if self._writer is not None:
                self.cancelled_in = self.now()
                self._drop()
            raise
        except TimeoutError as exc:
            epoch = self.now()
            self._drop()  # a late reply would be read as the next request's
            if isinstance(exc, NoReplyError):
                raise
            raise NoReplyError(op, epoch, self.timeout_s) from exc
        except (OSError, asyncio.IncompleteReadError):
            self._drop()
            raise

    def _drop(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def start(self) -> AsyncClient:
        await self._connect()
        if self._heartbeat_enabled:
            self._beat = asyncio.create_task(self._heartbeats())
        return self

    async def _heartbeats(self) -> None:
        interval = max(0.05, float(self.session.get("heartbeat_timeout_s", 30.0)) / 3)
        while not self._closed:
            await asyncio.sleep(interval)
            try:
                await self.call("heartbeat", self._heartbeat_args())
            except Exception:  # the next call reconnects or reports (a cancel still ends it)
                continue

    async def register_pools(self, pools: SharedPools) -> None:
        self.pools = pools
        registration = ("register_pools", pools.manifest())
        self._pools_registered(await self.call(*self._registration_args(registration)))
        self._registration = registration

    async def register_cuda_pools(self, pools: Mapping[str, DevicePool]) -> None:
        from hicache.transfer.cuda_ipc import export_cuda_pools, pools_device

        registration = ("register_cuda_pools", export_cuda_pools(pools))
        self.cuda_device = pools_device(pools)
        self._pools_registered(await self.call(*self._registration_args(registration)))
        self._registration = registration

    async def lookup(self, tokens: Sequence[int]) -> Lookup:
        return self._lookup_of(await self.call("lookup", {"tokens": list(tokens)}))

    async def lookup_keys(
        self,
        keys: PromptKeys | Sequence[int],
        *,
        wait_stored_s: float = 0.0,
        answer_at_once: bool = False,
    ) -> Lookup:
        """`Client.lookup_keys`: a lookup by the prompt's page keys (`page_keys`), waiting
        up to `wait_stored_s` for pages a store in flight is writing (never held with
        `answer_at_once`: the engine asks again)."""
        args = self._key_lookup_args(keys, wait_stored_s, answer_at_once)
        return self._lookup_of(await self.call("lookup_keys", args))

    async def lookup_many(self, prompts: Sequence[PromptKeys | Sequence[int]]) -> list[Lookup]:
        """`Client.lookup_many`: several lookups by keys in one frame, answered in order."""
        out = []
        for batch in self._lookup_batches(prompts):
            reply = await self.call("lookup_many", {"lookups": batch})
            out += [self._lookup_of(r) for r in reply["results"]]
        return out

    async def store(
        self,
        tokens: Sequence[int],
        device_pages: Mapping[str, Sequence[int | None]],
        snapshots: Mapping[str, Mapping[int, int]] | None = None,
        *,
        stream: Any = None,
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
        `stream.wait_stream(other)`), at the time of this call."""
        event, fence = self._engine_fence(stream, "store")  # this thread, before the request
        try:
            return await self.call("store", store_args(tokens, device_pages, snapshots, fence))
        except BaseException as exc:
            self._keep_fence(event, exc)  # no reply: alive until confirmed (_engine_fence)
            raise

    async def load(
        self,
        tokens: Sequence[int],
        device_pages: Mapping[str, Sequence[int]],
        skip_pages: int = 0,
        *,
        stream: Any = None,
    ) -> LoadHandle | None:
        event, fence = self._engine_fence(stream, "load")  # this thread, before the request
        try:
            reply = await self.call("load", load_args(tokens, device_pages, skip_pages, fence))
        except BaseException as exc:
            self._keep_fence(event, exc)  # no reply: alive until confirmed (_engine_fence)
            raise
        loop = asyncio.get_running_loop()

        def release(load_id: int) -> None:  # LoadHandle.done() runs off-loop or on it
            asyncio.run_coroutine_threadsafe(self.release(load_id), loop)

        return self._handle(reply, release, event)  # alive until the load ended

    async def prefetch(self, tokens: Sequence[int]) -> int:
        return int((await self.call("prefetch", {"tokens": list(tokens)}))["pages_fetched"])

    async def release(self, load_id: int) -> None:
        try:
            await self.call("release", {"load_id": load_id})
        except ClientError as exc:
            if exc.code != p.ErrorCode.OUT_OF_RANGE:
                raise

    async def stats(self) -> dict[str, Any]:
        return await self.call("stats")

    async def close(self) -> None:
        """Ends the session: the heartbeat task is cancelled and awaited, the connection
        and the pools closed (also when this caller is cancelled while it waits); a call in
        flight fails, and none reconnects after this."""
        self._closed = True
        try:
            if self._beat is not None:
                self._beat.cancel()
                if self._beat is not asyncio.current_task():
                    await asyncio.gather(self._beat, return_exceptions=True)  # ended on return
        finally:
            self._drop()
            if self.pools is not None:
                self.pools.close()


async def connect_async(address: str | Path, layer_map: LayerMap, **kwargs: Any) -> AsyncClient:
    return await AsyncClient(address, layer_map, **kwargs).start()
