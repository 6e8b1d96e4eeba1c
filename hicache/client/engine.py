"""The engine's side of the sidecar: `connect(address, ...)` -> `Client` (blocking) or
`await connect_async(...)` -> `AsyncClient`; both mirror the embedded API.

Lifecycle:
    client = connect(".hicache/engine.sock", layer_map, dtype="bfloat16", page_size_tokens=16)
    pools = client.create_pools(num_pages=64)    # KV pool in /dev/shm; compute with
    client.register_pools(pools)                 # pools.device_pools()[group].tensors
    hit = client.lookup(tokens)
    client.store(tokens, device_pages)           # after prefill wrote those pages
    handle = client.load(tokens, device_pages)   # None when nothing hits
    for layer_id in layers: handle.wait_layer(layer_id); ...   # reads shared memory
    handle.done()                                # final state; frees the load's slot
    client.close()                               # also removes the pool file

A heartbeat thread (task, for the async client) keeps the session alive and carries the
engine's per-layer stall times to the sidecar's metrics. When the connection drops, the next
call reconnects once, says hello and re-registers the same pools (loads in flight on the old
connection fail with `LoadLostError`), then retries the call.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.errors import HicacheError
from hicache.memory import DevicePool, GroupGeometry, torch_dtype
from hicache.model import LayerMap
from hicache.service import protocol as p
from hicache.service.shm import CounterFile, LoadState, SharedPools


class ClientError(HicacheError):
    """The sidecar answered with an error (`code` is one of protocol.ErrorCode)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class LoadFailedError(HicacheError):
    """A load ended failed or cancelled before the layer waited on landed."""


class LoadLostError(HicacheError):
    """The connection (and its load slots) went away while the load was in flight."""


@dataclass(frozen=True, slots=True)
class Lookup:
    page_size_tokens: int
    tokens_l2: int
    tokens_total: int


def _address(address: str | Path) -> tuple[int, Any]:
    text = str(address)
    if text.startswith("tcp://"):
        host, _, port = text[len("tcp://") :].rpartition(":")
        return socket.AF_INET, (host or "127.0.0.1", int(port))
    return socket.AF_UNIX, text


_STATES = {
    LoadState.DONE: "done",
    LoadState.FAILED: "failed",
    LoadState.CANCELLED: "cancelled",
}


class LoadHandle:
    """One load: `wait_layer(layer_id)` from the engine's forward thread; `done()` at the end."""

    def __init__(
        self,
        release: Any,
        layer_map: LayerMap,
        counters: CounterFile,
        generation: int,
        current_generation: Any,
        reply: dict[str, Any],
        stalls: list[float],
    ):
        self.load_id: int = reply["load_id"]
        self.slot: int = reply["slot"]
        self.tokens: int = reply["tokens"]
        self.failed: dict[str, list[int]] = reply["failed"]
        self._release = release
        self._layer_map = layer_map
        self._row = counters.array[self.slot]
        self._generation = generation
        self._current = current_generation
        self._stalls = stalls
        self._final: str | None = None
        # ns from a layer landing (sidecar's clock) to this engine seeing it, for the layers
        # it had to wait for; CLOCK_MONOTONIC is one clock for every process of the machine
        self.signal_ns: list[int] = []

    def _check(self) -> None:
        if self._current() != self._generation or int(self._row[0]) != self.load_id:
            raise LoadLostError(
                f"load {self.load_id}: the sidecar connection was reset while it was in flight"
            )

    def wait_layer(self, layer_id: int, timeout_s: float = 60.0) -> None:
        index = self._layer_map.stage_index(layer_id)
        row = self._row
        if row[1] > index:
            return
        started = time.perf_counter()
        spins = 0
        while row[1] <= index:
            state = int(row[2])
            if state in (LoadState.FAILED, LoadState.CANCELLED):
                raise LoadFailedError(
                    f"load {self.load_id} ended {_STATES[LoadState(state)]} before layer "
                    f"{layer_id} landed"
                )
            self._check()
            spins += 1
            if spins < 2000:
                os.sched_yield()  # the copy thread may need this core
            else:
                time.sleep(50e-6)
                if time.perf_counter() - started > timeout_s:
                    raise LoadFailedError(
                        f"load {self.load_id}: layer {layer_id} did not land in {timeout_s} s"
                    )
        seen = time.monotonic_ns()
        if row[1] == index + 1:
            self.signal_ns.append(seen - int(row[4]))
        self._stalls.append(time.perf_counter() - started)

    def state(self) -> str:
        """running / done / failed / cancelled. A load that ended before its connection was
        reset keeps its final state (the old counter mapping is never reused)."""
        if self._final is not None:
            return self._final
        if int(self._row[0]) == self.load_id:
            final = _STATES.get(LoadState(int(self._row[2])))
            if final is not None:
                return final
        self._check()
        return "running"

    def done(self, timeout_s: float = 60.0) -> str:
        """Wait for the load to end; returns done / failed / cancelled and frees its slot."""
        deadline = time.perf_counter() + timeout_s
        while (state := self._poll(deadline, timeout_s)) is None:
            time.sleep(20e-6)
        return state

    async def finished(self, timeout_s: float = 60.0) -> str:
        """`done()` for an event loop: waits without blocking it."""
        deadline = time.perf_counter() + timeout_s
        # the state is a word another process writes in shared memory: nothing to await on
        while (state := self._poll(deadline, timeout_s)) is None:  # noqa: ASYNC110
            await asyncio.sleep(100e-6)
        return state

    def _poll(self, deadline: float, timeout_s: float) -> str | None:
        """The final state once the load ended (its slot released then), else None."""
        if self._final is not None:
            return self._final
        state = self.state()
        if state == "running":
            if time.perf_counter() > deadline:
                raise LoadFailedError(f"load {self.load_id} did not end in {timeout_s} s")
            return None
        self._final = state
        self._release(self.load_id)
        return state

    def cancel(self) -> None:
        if self._final is None:
            self._release(self.load_id)


class _Base:
    """State shared by the blocking and async clients."""

    def __init__(
        self,
        layer_map: LayerMap,
        dtype: str,
        page_size_tokens: int,
        tp_rank: int,
        tenant: str,
        token: str | None,
        engine: str,
    ):
        self.layer_map = layer_map
        self.dtype = dtype
        self.page_size_tokens = page_size_tokens
        self.geometries = {
            g.name: GroupGeometry(g, torch_dtype(dtype), page_size_tokens) for g in layer_map.groups
        }
        self._hello = {
            "protocol": p.PROTOCOL_VERSION,
            "layout": p.layout_summary(layer_map, dtype, page_size_tokens),
            "engine": engine,
            "pid": os.getpid(),
            "tp_rank": tp_rank,
            "tenant": tenant,
            "token": token,
        }
        self._ids = itertools.count(1)
        self.session: dict[str, Any] = {}
        self.pools: SharedPools | None = None
        self._registration: tuple[str, dict[str, Any]] | None = None  # replayed on reconnect
        self.counters: CounterFile | None = None
        self.generation = 0
        self.stalls: list[float] = []

    def _request(self, op: str, args: Mapping[str, Any]) -> tuple[int, bytes]:
        request_id = next(self._ids)
        return request_id, p.frame({"op": op, "id": request_id, "args": dict(args)})

    @staticmethod
    def _result(request_id: int, reply: Any) -> dict[str, Any]:
        if not isinstance(reply, dict) or reply.get("id") not in (request_id, 0):
            raise ClientError(p.ErrorCode.INTERNAL, f"unexpected reply {reply!r:.200}")
        if not reply.get("ok"):
            err = reply.get("error", {})
            raise ClientError(err.get("code", "?"), err.get("message", "?"))
        result: dict[str, Any] = reply["result"]
        return result

    def _pools_registered(self, reply: dict[str, Any]) -> None:
        self.counters = CounterFile.open(reply["counters"], reply["slots"])
        self.generation += 1

    def _take_stalls(self) -> list[float]:
        stalls, self.stalls = self.stalls[:4096], self.stalls[4096:]
        return stalls

    def create_pools(self, num_pages: int | Mapping[str, int]) -> SharedPools:
        """The engine's KV pool in shared memory, laid out as the sidecar expects."""
        shm_dir = self.session.get("shm_dir", "/dev/shm")
        return SharedPools.create(self.geometries, num_pages, shm_dir)

    def _handle(self, reply: dict[str, Any], release: Any) -> LoadHandle | None:
        if reply["load_id"] is None:
            return None
        assert self.counters is not None
        return LoadHandle(
            release,
            self.layer_map,
            self.counters,
            self.generation,
            lambda: self.generation,
            reply,
            self.stalls,
        )


def _pages(device_pages: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    return {group: [int(x) for x in pages] for group, pages in device_pages.items()}


class Client(_Base):
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
    ):
        super().__init__(layer_map, dtype, page_size_tokens, tp_rank, tenant, token, engine)
        self.address = address
        self.timeout_s = timeout_s
        self.reconnect = reconnect
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = threading.Event()
        self._connect()
        self._beat: threading.Thread | None = None
        if heartbeat:
            self._beat = threading.Thread(target=self._heartbeats, daemon=True)
            self._beat.start()

    # ---- transport ------------------------------------------------------------------------

    def _connect(self) -> None:
        family, addr = _address(self.address)
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        if family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.connect(addr)
        self._sock = sock
        self.session = self._exchange("hello", self._hello)
        if self._registration is not None:
            self._pools_registered(self._exchange(*self._registration))

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
        return self._result(request_id, p.unpack(body))

    def call(self, op: str, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
        with self._lock:
            if self._closed.is_set():
                raise ClientError("closed", "the client is closed")
            try:
                if self._sock is None:
                    self._connect()
                return self._exchange(op, args or {})
            except (ConnectionError, BrokenPipeError, OSError) as exc:
                if isinstance(exc, TimeoutError) or not self.reconnect:
                    # a late reply would be read as the next request's: start afresh
                    self._drop_socket()
                    raise
                self._drop_socket()
                self._connect()
                return self._exchange(op, args or {})

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
                self.call("heartbeat", {"layer_stall_s": self._take_stalls()})
            except Exception:  # the next call reconnects or reports; nothing to do here
                continue

    # ---- the API ---------------------------------------------------------------------------

    def register_pools(self, pools: SharedPools) -> None:
        """Share a pool made by `create_pools` (the CPU data plane)."""
        self.pools = pools
        self._registration = ("register_pools", pools.manifest())
        self._pools_registered(self.call(*self._registration))

    def register_cuda_pools(self, pools: Mapping[str, DevicePool]) -> None:
        """Share the engine's CUDA pools by IPC handle (a sidecar with device.kind: cuda); keep
        the tensors alive while registered."""
        from hicache.transfer.cuda_ipc import export_cuda_pools

        self._registration = ("register_cuda_pools", export_cuda_pools(pools))
        self._pools_registered(self.call(*self._registration))

    def lookup(self, tokens: Sequence[int]) -> Lookup:
        r = self.call("lookup", {"tokens": list(tokens)})
        return Lookup(r["page_size_tokens"], r["tokens_l2"], r["tokens_total"])

    def store(
        self, tokens: Sequence[int], device_pages: Mapping[str, Sequence[int]]
    ) -> dict[str, Any]:
        return self.call("store", {"tokens": list(tokens), "device_pages": _pages(device_pages)})

    def load(
        self,
        tokens: Sequence[int],
        device_pages: Mapping[str, Sequence[int]],
        skip_pages: int = 0,
    ) -> LoadHandle | None:
        """Load the prompt's hit into `device_pages` (per group, in token order; one snapshot
        page for a state group). `skip_pages`: the first pages are on the device already."""
        reply = self.call(
            "load",
            {
                "tokens": list(tokens),
                "device_pages": _pages(device_pages),
                "skip_pages": skip_pages,
            },
        )
        return self._handle(reply, self.release)

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
            self.pools.unlink()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(address: str | Path, layer_map: LayerMap, **kwargs: Any) -> Client:
    """A blocking client; `address` is a Unix socket path or `tcp://host:port`."""
    return Client(address, layer_map, **kwargs)


class AsyncClient(_Base):
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
        )
        if kwargs:
            raise TypeError(f"unknown arguments {sorted(kwargs)}")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()
        self._beat: asyncio.Task[None] | None = None
        self._closed = False

    async def _connect(self) -> None:
        family, addr = _address(self.address)
        if family == socket.AF_UNIX:
            self._reader, self._writer = await asyncio.open_unix_connection(addr)
        else:
            self._reader, self._writer = await asyncio.open_connection(*addr)
        self.session = await self._exchange("hello", self._hello)
        if self._registration is not None:
            self._pools_registered(await self._exchange(*self._registration))

    async def _exchange(self, op: str, args: Mapping[str, Any]) -> dict[str, Any]:
        assert self._reader is not None
        assert self._writer is not None
        request_id, data = self._request(op, args)
        self._writer.write(data)
        await self._writer.drain()
        header = await asyncio.wait_for(self._reader.readexactly(p.HEADER.size), self.timeout_s)
        (size,) = p.HEADER.unpack(header)
        payload = await asyncio.wait_for(self._reader.readexactly(size), self.timeout_s)
        return self._result(request_id, p.unpack(payload))

    async def call(self, op: str, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
        async with self._lock:
            if self._closed:
                raise ClientError("closed", "the client is closed")
            try:
                if self._writer is None:
                    await self._connect()
                return await self._exchange(op, args or {})
            except TimeoutError:
                self._drop()  # a late reply would be read as the next request's
                raise
            except (ConnectionError, asyncio.IncompleteReadError):
                if not self.reconnect:
                    self._drop()
                    raise
                self._drop()
                await self._connect()
                return await self._exchange(op, args or {})

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
                await self.call("heartbeat", {"layer_stall_s": self._take_stalls()})
            except (ClientError, ConnectionError, OSError, TimeoutError):
                continue

    async def register_pools(self, pools: SharedPools) -> None:
        self.pools = pools
        self._registration = ("register_pools", pools.manifest())
        self._pools_registered(await self.call(*self._registration))

    async def register_cuda_pools(self, pools: Mapping[str, DevicePool]) -> None:
        from hicache.transfer.cuda_ipc import export_cuda_pools

        self._registration = ("register_cuda_pools", export_cuda_pools(pools))
        self._pools_registered(await self.call(*self._registration))

    async def lookup(self, tokens: Sequence[int]) -> Lookup:
        r = await self.call("lookup", {"tokens": list(tokens)})
        return Lookup(r["page_size_tokens"], r["tokens_l2"], r["tokens_total"])

    async def store(
        self, tokens: Sequence[int], device_pages: Mapping[str, Sequence[int]]
    ) -> dict[str, Any]:
        return await self.call(
            "store", {"tokens": list(tokens), "device_pages": _pages(device_pages)}
        )

    async def load(
        self,
        tokens: Sequence[int],
        device_pages: Mapping[str, Sequence[int]],
        skip_pages: int = 0,
    ) -> LoadHandle | None:
        reply = await self.call(
            "load",
            {
                "tokens": list(tokens),
                "device_pages": _pages(device_pages),
                "skip_pages": skip_pages,
            },
        )
        loop = asyncio.get_running_loop()

        def release(load_id: int) -> None:  # LoadHandle.done() runs off-loop or on it
            asyncio.run_coroutine_threadsafe(self.release(load_id), loop)

        return self._handle(reply, release)

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
        self._closed = True
        if self._beat is not None:
            self._beat.cancel()
        self._drop()
        if self.pools is not None:
            self.pools.unlink()


async def connect_async(address: str | Path, layer_map: LayerMap, **kwargs: Any) -> AsyncClient:
    return await AsyncClient(address, layer_map, **kwargs).start()
