"""`ClientBase`: what the blocking and the async engine clients share — the hello and its
layout summary, request framing and reply checking, shared pools and the counter file, the
per-layer stalls reported with heartbeats, and page keys computed with the keyers the hello
reply gives (`page_keys`; `keys.py`) for `lookup_keys` / `lookup_many`."""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache.channel import protocol as p
from hicache.channel.counters import CounterFile
from hicache.channel.shm import SharedPools
from hicache.client.handle import (
    ClientError,
    Epoch,
    LoadHandle,
    Lookup,
    NoReplyError,
    SidecarUnreachableError,
)
from hicache.client.keys import KeySpec, PromptKeys
from hicache.errors import ConfigError
from hicache.memory import CacheDtypes, group_geometries
from hicache.model import LayerMap

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot): with the pid, names one process
    for good (pids are reused, start times with them never)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


_HOW = (
    "write a Unix socket as a path (/run/hicache/engine.sock, ./engine.sock) and TCP as "
    "tcp://host:port (or host:port; IPv6 as [::1]:port)"
)


def parse_address(address: str | Path) -> tuple[int, Any]:
    """Where `connect` goes, as (socket family, address). A `Path`, or a string with a '/' or
    with neither '/' nor ':' (`engine.sock`), or `unix://PATH`, is a Unix socket path;
    `tcp://host:port` is TCP, and so is a bare `host:port` whose host is an IPv4 address,
    `[v6]`, `localhost` or empty (127.0.0.1). Anything else (`name:9400`, which could name
    either, `host:notaport`, another scheme, an empty string) is refused (ConfigError)
    saying how to write each."""
    if isinstance(address, Path):
        return socket.AF_UNIX, str(address)
    text = str(address)
    if text.startswith("unix://") and len(text) > len("unix://"):
        return socket.AF_UNIX, text[len("unix://") :]
    if text.startswith("tcp://"):
        return _host_port(text, text[len("tcp://") :])
    if not text or "://" in text:
        raise ConfigError(f"sidecar address {text!r} is not one; {_HOW}")
    if "/" in text or ":" not in text:
        return socket.AF_UNIX, text
    host = text.rpartition(":")[0]
    if not (host in ("", "localhost") or host.startswith("[") or _is_ipv4(host)):
        # `name:9400` is a file of that name as much as a host: the writer must say which
        raise ConfigError(
            f"sidecar address {text!r} is ambiguous: write tcp://{text} for TCP to host "
            f"{host!r}, or ./{text} for a Unix socket file of that name; {_HOW}"
        )
    return _host_port(text, text)


def _is_ipv4(host: str) -> bool:
    parts = host.split(".")
    return len(parts) == 4 and all(p.isdigit() and int(p) < 256 for p in parts)


def _host_port(text: str, rest: str) -> tuple[int, Any]:
    if rest.startswith("["):
        host, close, port = rest[1:].partition("]")
        if not close or not port.startswith(":"):
            raise ConfigError(f"sidecar address {text!r}: an IPv6 host is [addr]:port; {_HOW}")
        family, port = socket.AF_INET6, port[1:]
    else:
        host, _, port = rest.rpartition(":")
        family = socket.AF_INET
        if ":" in host:
            raise ConfigError(f"sidecar address {text!r}: put an IPv6 host in [ ]; {_HOW}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"sidecar address {text!r}: {port!r} is not a TCP port (1-65535), and a Unix "
            f"socket path needs a '/'; {_HOW}"
        )
    return family, (host or "127.0.0.1", int(port))


def describe_address(family: int, addr: Any) -> str:
    if family == socket.AF_UNIX:
        return f"Unix socket {addr!r}"
    host, port = addr
    return f"tcp://[{host}]:{port}" if family == socket.AF_INET6 else f"tcp://{host}:{port}"


def unreachable(
    family: int, addr: Any, exc: BaseException, timeout_s: float
) -> SidecarUnreachableError:
    """A failed connect as the engine should read it: the address tried and why."""
    unix = family == socket.AF_UNIX
    if isinstance(exc, FileNotFoundError):
        why = "no such file (is hicache serve running? the path is its service.socket_path)"
    elif isinstance(exc, ConnectionRefusedError):
        why = (
            "connection refused (the socket file is there but nothing listens: a stopped "
            "hicache serve)"
            if unix
            else "connection refused (nothing listens there: is service.tcp_port set?)"
        )
    elif isinstance(exc, PermissionError):
        why = (
            "permission denied (the socket is its owner's only: run the engine as the "
            "sidecar's user)"
        )
    elif isinstance(exc, TimeoutError):
        why = f"timed out after {timeout_s:g} s"
    elif isinstance(exc, socket.gaierror):
        why = f"cannot resolve the host ({exc.strerror or exc})"
    else:
        why = (exc.strerror if isinstance(exc, OSError) else None) or f"{type(exc).__name__}: {exc}"
    return SidecarUnreachableError(
        f"cannot connect to the sidecar at {describe_address(family, addr)}: {why}"
    )


class ClientBase:
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
        state_dtype: str | None = None,
        ssm_state_dtype: str | None = None,
        role: str = "engine",
        tp_size: int | None = None,
    ):
        self.layer_map = layer_map
        # the engine's tensor-parallel size: default, the one its layout was sharded for
        self.tp_size = layer_map.layout.tp_size if tp_size is None else tp_size
        self.dtype = dtype
        self.page_size_tokens = page_size_tokens
        dtypes = CacheDtypes.from_names(dtype, state_dtype, ssm_state_dtype)
        self.geometries = group_geometries(layer_map.groups, dtypes, page_size_tokens)
        self._hello = {
            "protocol": p.PROTOCOL_VERSION,
            "layout": p.layout_summary(layer_map, self.geometries, page_size_tokens),
            "engine": engine,
            "pid": os.getpid(),
            "tp_rank": tp_rank,
            "tenant": tenant,
            "token": token,
        }
        if role != "engine":  # sidecars before the role field refuse unknown hello keys
            self._hello["role"] = role
        if self.tp_size != 1:  # likewise: sent only when tensor-parallel
            self._hello["tp_size"] = self.tp_size
        self._ids = itertools.count(1)
        self.session: dict[str, Any] = {}
        self.pools: SharedPools | None = None
        self._registration: tuple[str, dict[str, Any]] | None = None  # replayed on reconnect
        self.counters: CounterFile | None = None
        self._pending_counters: CounterFile | None = None  # sent, not yet acknowledged
        self.generation = 0
        # the epoch under which the sidecar last registered this client's memory (None: not
        # yet): every earlier session of that sidecar holding it has ended (`confirmed`)
        self.epoch: Epoch | None = None
        self.sidecar_process: tuple[int, int | None] | None = None  # the socket's peer
        self.stalls: list[float] = []
        self.loads_starved = 0  # since the last heartbeat: `starved()`
        # CUDA pools: their device, and the fence events of requests that got no reply, each
        # kept until the sidecar confirmed its session over (`_keep_fence`)
        self.cuda_device: Any = None
        self._unanswered_fences: list[tuple[Epoch, Any]] = []
        self._fences_lock = threading.Lock()
        self._key_spec: KeySpec | None = None
        self._key_session: dict[str, Any] | None = None

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

    def _registration_args(
        self, registration: tuple[str, dict[str, Any]] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """A registration to send (`registration`, or the one replayed on reconnect), with a
        new counter memfd: each session's loads get rows no earlier session can still write.
        The one replayed is set only once the sidecar took it (`_registered`), so a reconnect
        in the middle of registering never sends it twice."""
        registration = registration or self._registration
        assert registration is not None
        if self._pending_counters is not None:
            self._pending_counters.close()
        slots = int(self.session.get("load_slots", 64))
        self._pending_counters = CounterFile.create(slots)
        op, args = registration
        return op, {**args, "counters_fd": self._pending_counters.fd}

    def _pools_registered(self, reply: dict[str, Any]) -> None:
        counters, self._pending_counters = self._pending_counters, None
        assert counters is not None
        if reply.get("slots") != counters.slots:
            counters.close()
            raise ClientError(
                p.ErrorCode.INTERNAL,
                f"register: the sidecar mapped {reply.get('slots')!r} load slots; the counter "
                f"memfd holds {counters.slots}",
            )
        counters.close()  # the sidecar holds its mapping; ours stays while referenced
        self.counters = counters
        self.generation += 1
        # a sidecar before epochs names no session here: hello's, the same session
        self.epoch = Epoch(self.sidecar_process, int(reply.get("session", self.now().session)))

    def now(self) -> Epoch:
        """The epoch a request sent now runs in (the session of the latest hello)."""
        return Epoch(self.sidecar_process, int(self.session.get("session", 0)))

    def confirmed(self, epoch: Epoch) -> bool:
        """No op of `epoch` (`NoReplyError.epoch`, `LoadHandle.epoch`) can still touch this
        client's memory: the same sidecar process registered that memory again under a later
        session, which it does only once every other session holding it ended, copies and
        all (service/claims.py); or that sidecar process has exited."""
        registered = self.epoch
        if (
            registered is not None
            and registered.sidecar == epoch.sidecar
            and registered.session > epoch.session
        ):
            return True
        if epoch.sidecar is None:  # the kernel did not name it: no way to see it exit
            return False
        pid, start = epoch.sidecar
        return start is not None and _process_start(pid) != start

    def _note_peer(self, sock: socket.socket) -> None:
        """The Unix socket's peer (the sidecar) as the kernel names it, and its start time."""
        if sock.family != socket.AF_UNIX:
            return
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        pid = _PEERCRED.unpack(raw)[0]
        if pid > 0:
            self.sidecar_process = (pid, _process_start(pid))

    def _check_epoch(self, op: str, result: dict[str, Any]) -> dict[str, Any]:
        """A reply that names its session names this connection's: one of an old epoch is
        never taken for a new op's."""
        named = result.get("session")
        if named is not None and op != "hello" and named != self.session.get("session"):
            raise ClientError(
                p.ErrorCode.INTERNAL,
                f"{op}: a reply of session {named} arrived on session "
                f"{self.session.get('session')}",
            )
        return result

    def key_spec(self) -> KeySpec:
        """The session's keyers, from the latest hello reply (kept while a reconnect's hello
        gives the same roots, so keys computed before stay valid)."""
        session = self.session
        if self._key_spec is None or self._key_session is not session:
            spec = KeySpec.of(session)
            if spec is None:
                raise ClientError(
                    p.ErrorCode.UNKNOWN_OP,
                    "the sidecar's hello gives no page-key roots: it predates lookup_keys; "
                    "look up by tokens (lookup)",
                )
            if spec.page_size_tokens != self.page_size_tokens:
                raise ClientError(
                    p.ErrorCode.REFUSED,
                    f"the sidecar keys pages of {spec.page_size_tokens} tokens; this client "
                    f"has {self.page_size_tokens}",
                )
            if self._key_spec is not None and self._key_spec.same(spec):
                spec = self._key_spec
            self._key_spec, self._key_session = spec, session
        return self._key_spec

    def page_keys(self, tokens: Sequence[int], extend: PromptKeys | None = None) -> PromptKeys:
        """The prompt's page keys in every cached group, computed here once, exactly as the
        sidecar's index computes them; `extend`: this prompt's earlier keys (only later
        pages are hashed). Pure CPU (no request); on the async client too."""
        return self.key_spec().keys(tokens, extend)

    def _key_args(self, keys: PromptKeys | Sequence[int]) -> dict[str, Any]:
        spec = self.key_spec()
        if not isinstance(keys, PromptKeys):
            return spec.keys(keys).args()
        if keys.spec is not spec and not keys.spec.same(spec):
            raise ClientError(
                p.ErrorCode.REFUSED,
                "these page keys were computed under key roots the sidecar no longer gives "
                "(it restarted with another tenant salt or model); compute them again "
                "(page_keys)",
            )
        return keys.args()

    def _lookup_batches(
        self, prompts: Sequence[PromptKeys | Sequence[int]]
    ) -> list[list[dict[str, Any]]]:
        """lookup_many's frames: at most MAX_LOOKUPS lookups and about 4 MiB of keys each
        (well under the sidecar's default 16 MiB frame limit)."""
        batches: list[list[dict[str, Any]]] = [[]]
        size = 0
        for prompt in prompts:
            args = self._key_args(prompt)
            nbytes = sum(len(blob) for blob in args["keys"].values())
            if batches[-1] and (len(batches[-1]) >= p.MAX_LOOKUPS or size + nbytes > 4 << 20):
                batches.append([])
                size = 0
            batches[-1].append(args)
            size += nbytes
        return batches if batches[0] else []

    @staticmethod
    def _lookup_of(reply: Mapping[str, Any]) -> Lookup:
        return Lookup(
            reply["page_size_tokens"],
            reply["tokens_l2"],
            reply["tokens_total"],
            reply.get("store_wait"),
            reply.get("store_writing"),
        )

    def _key_lookup_args(
        self, keys: PromptKeys | Sequence[int], wait_stored_s: float, answer_at_once: bool
    ) -> dict[str, Any]:
        args = self._key_args(keys)
        if wait_stored_s > 0:  # only then: a sidecar that predates the field is asked as before
            args["wait_stored_s"] = float(wait_stored_s)
            if answer_at_once:
                args["answer_at_once"] = True
        return args

    def _engine_fence(self, stream: Any, op: str) -> tuple[Any, bytes | None]:
        """A store's or load's `fence`: with CUDA pools, an interprocess event recorded now on
        `stream` (default: this thread's current stream on the pools' device) and its IPC
        handle, so the sidecar's copies run after the work queued there so far (a store's
        kernels that wrote the pages; for a load, whatever still uses or zeroes the pages
        it fills); (None, None) with shared-memory pools (the engine works on the CPU).

        The event's lifecycle (an imported IPC event used, or destroyed, after its exporter
        destroyed it is undefined in CUDA, so the engine's must outlive every use there):
        recorded -> request sent -> answered: a store's event may go with its reply (the
        sidecar settled the store and dropped its opened copy before answering), a load's
        stays with its `LoadHandle` until the load ended (`done()` / `finished()`), and one
        answered with an error may go; or no reply (`NoReplyError`, the connection broke):
        the sidecar may still wait on it in that session, so it is kept (`_keep_fence`)
        until `confirmed(epoch)` — however many later requests went meanwhile."""
        if self.cuda_device is None:
            if stream is not None:
                raise ClientError(
                    p.ErrorCode.BAD_REQUEST,
                    f"{op}: a stream orders CUDA work; this client registered shared-memory "
                    "pools (register_cuda_pools gives the sidecar CUDA ones)",
                )
            return None, None
        from hicache.transfer.cuda_ipc import export_fence  # CUDA only when used

        self._keep_fence(None, None)  # forget the unanswered ones confirmed over by now
        event, handle = export_fence(self.cuda_device, stream)
        return event, handle

    def record_fence(self, stream: Any = None, op: str = "store") -> tuple[Any, bytes | None]:
        """`_engine_fence` now, on the calling thread, for a `store(..., fence=...)` sent later
        from another thread: the fence marks the work queued on `stream` at this point (an
        engine's hook, on its own thread), not whatever the stream holds when the request
        goes out."""
        return self._engine_fence(stream, op)

    def _keep_fence(self, event: Any, failure: BaseException | None) -> None:
        """A fenced request failed with `failure`: an error reply (`ClientError`) lets its
        event go; anything else may have left the request running in the sidecar, in the
        session `NoReplyError.epoch` names (else the latest hello's, at least the one it was
        sent in), so the event is kept until `confirmed` says that session ended. Every
        call forgets the kept events whose sessions are confirmed over by now."""
        with self._fences_lock:
            self._unanswered_fences = [
                (epoch, kept)
                for epoch, kept in self._unanswered_fences
                if not self.confirmed(epoch)
            ]
            if event is None or failure is None or isinstance(failure, ClientError):
                return
            epoch = failure.epoch if isinstance(failure, NoReplyError) else self.now()
            self._unanswered_fences.append((epoch, event))

    def _take_stalls(self) -> list[float]:
        stalls, self.stalls = self.stalls[:4096], self.stalls[4096:]
        return stalls

    def starved(self, loads: int = 1) -> None:
        """The engine recomputed `loads` loads for want of staging pages of its own: counted
        by the sidecar (`/v1/stats`, `hicache_engine_loads_starved_total`) at the next
        heartbeat."""
        self.loads_starved += loads

    def _heartbeat_args(self) -> dict[str, Any]:
        starved, self.loads_starved = self.loads_starved, 0
        return {"layer_stall_s": self._take_stalls()} | (
            {"loads_starved": starved} if starved else {}
        )

    def create_pools(
        self, num_pages: int | Mapping[str, int], *, prefault: bool = True
    ) -> SharedPools:
        """The engine's KV pool in a sealed memfd, laid out as the sidecar expects; every
        page allocated and mapped now unless `prefault` is False (`SharedPools.create`)."""
        return SharedPools.create(self.geometries, num_pages, prefault=prefault)

    def _handle(self, reply: dict[str, Any], release: Any, fence: Any = None) -> LoadHandle | None:
        """The load's handle (None: nothing hit), holding the load's fence event until the
        load ended (`_engine_fence`)."""
        if reply["load_id"] is None:
            return None
        assert self.counters is not None
        handle = LoadHandle(
            release,
            self.layer_map,
            self.counters,
            self.generation,
            lambda: self.generation,
            reply,
            self.stalls,
        )
        handle.fence_event = fence
        return handle.settled_by(
            Epoch(self.sidecar_process, int(reply.get("session", self.now().session)))
        )


def page_lists(device_pages: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    return {group: [int(x) for x in pages] for group, pages in device_pages.items()}


def page_lists_held(
    device_pages: Mapping[str, Sequence[int | None]],
) -> dict[str, list[int | None]]:
    """A store's pages on the wire: None where the engine no longer holds one."""
    return {
        group: [None if x is None else int(x) for x in pages]
        for group, pages in device_pages.items()
    }


def load_args(
    tokens: Sequence[int],
    device_pages: Mapping[str, Sequence[int]],
    skip_pages: int,
    fence: bytes | None = None,
) -> dict[str, Any]:
    """A load's arguments on the wire; the fence's IPC event handle only for CUDA pools (an
    older sidecar refuses keys it does not know)."""
    extra: dict[str, Any] = {} if fence is None else {"fence": fence}
    return {
        **extra,
        "tokens": list(tokens),
        "device_pages": page_lists(device_pages),
        "skip_pages": skip_pages,
    }


def store_args(
    tokens: Sequence[int],
    device_pages: Mapping[str, Sequence[int | None]],
    snapshots: Mapping[str, Mapping[int, int]] | None,
    fence: bytes | None = None,
) -> dict[str, Any]:
    """A store's arguments on the wire: token groups' pages (None where the engine no longer
    holds one), state groups' snapshots as [num_tokens, slot] pairs, and the fence's IPC
    event handle for CUDA pools (sent only when there is one)."""
    extra: dict[str, Any] = {} if fence is None else {"fence": fence}
    return {
        **extra,
        "tokens": list(tokens),
        "device_pages": page_lists_held(device_pages),
        "snapshots": {
            group: [[int(n), int(slot)] for n, slot in sorted(given.items())]
            for group, given in (snapshots or {}).items()
        },
    }
