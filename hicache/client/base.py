"""`ClientBase`: what the blocking and the async engine clients share — the hello and its
layout summary, request framing and reply checking, shared pools and the counter file, the
per-layer stalls reported with heartbeats."""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache.client.handle import ClientError, LoadHandle
from hicache.memory import CacheDtypes, GroupGeometry
from hicache.model import LayerMap
from hicache.service import protocol as p
from hicache.service.shm import CounterFile, SharedPools


def parse_address(address: str | Path) -> tuple[int, Any]:
    text = str(address)
    if text.startswith("tcp://"):
        host, _, port = text[len("tcp://") :].rpartition(":")
        return socket.AF_INET, (host or "127.0.0.1", int(port))
    return socket.AF_UNIX, text


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
    ):
        self.layer_map = layer_map
        self.dtype = dtype
        self.page_size_tokens = page_size_tokens
        dtypes = CacheDtypes.from_names(dtype, state_dtype, ssm_state_dtype)
        self.geometries = {
            g.name: GroupGeometry.of(g, dtypes, page_size_tokens) for g in layer_map.groups
        }
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
        self._ids = itertools.count(1)
        self.session: dict[str, Any] = {}
        self.pools: SharedPools | None = None
        self._registration: tuple[str, dict[str, Any]] | None = None  # replayed on reconnect
        self.counters: CounterFile | None = None
        self._pending_counters: CounterFile | None = None  # sent, not yet acknowledged
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

    def _take_stalls(self) -> list[float]:
        stalls, self.stalls = self.stalls[:4096], self.stalls[4096:]
        return stalls

    def create_pools(self, num_pages: int | Mapping[str, int]) -> SharedPools:
        """The engine's KV pool in a sealed memfd, laid out as the sidecar expects."""
        return SharedPools.create(self.geometries, num_pages)

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


def page_lists(device_pages: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    return {group: [int(x) for x in pages] for group, pages in device_pages.items()}


def store_args(
    tokens: Sequence[int],
    device_pages: Mapping[str, Sequence[int | None]],
    snapshots: Mapping[str, Mapping[int, int]] | None,
) -> dict[str, Any]:
    """A store's arguments on the wire: token groups' pages (None where the engine no longer
    holds one), state groups' snapshots as [num_tokens, slot] pairs."""
    return {
        "tokens": list(tokens),
        "device_pages": {
            group: [None if x is None else int(x) for x in pages]
            for group, pages in device_pages.items()
        },
        "snapshots": {
            group: [[int(n), int(slot)] for n, slot in sorted(given.items())]
            for group, given in (snapshots or {}).items()
        },
    }
