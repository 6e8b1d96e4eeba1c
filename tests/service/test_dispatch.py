"""One handler per op (service/dispatch.py): its reply inline when nothing must be awaited, a
`Later` when something must (a lookup L3 may extend, a store) — at `LookupOps` over a fake
cache, and at the server's `answer_now`, which a connection calls inside `data_received`."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import msgpack

from hicache.assembly.sidecar import sidecar_plan
from hicache.channel import protocol as p
from hicache.config import load_deployment
from hicache.index import Hit
from hicache.service.dispatch import Later
from hicache.service.metrics import ServiceMetrics
from hicache.service.namespaces import NamespaceKey
from hicache.service.ops_lookup import LookupOps
from hicache.service.server import EngineServer
from hicache.service.sessions import Session
from hicache.service.state import ServerState
from hicache.service.store_waits import StoreWaits
from hicache.transfer import CpuCopyBackend
from tests.service.conftest import write_config

PAGE = 16


class FakeCache:
    """The index holds 2 pages of any prompt; L3 holds 2 more, found only by discovery; no
    store in flight (the planner has nothing pending)."""

    def __init__(self, l3_may_extend: bool):
        self.l3_may_extend = l3_may_extend
        self.discovered: list[list[int]] = []
        self.planner = SimpleNamespace(pending={})

    def lookup(self, tokens: Sequence[int]) -> Hit:
        return Hit(PAGE, 2, 4 if self.discovered else 2)

    def needs_discovery(self, tokens: Sequence[int], hit: Hit) -> bool:
        return self.l3_may_extend and not self.discovered

    async def discover(self, tokens: Sequence[int]) -> int:
        self.discovered.append(list(tokens))
        return 2


def lookup_ops(cache: FakeCache, metrics: ServiceMetrics) -> LookupOps:
    namespace = SimpleNamespace(cache=cache, key=NamespaceKey(0, ""))
    state = SimpleNamespace(
        readable=lambda session, op: namespace,
        deployment=SimpleNamespace(model=SimpleNamespace(page_size_tokens=PAGE)),
        metrics=metrics,
        store_waits=StoreWaits(),
    )
    return LookupOps(cast(ServerState, state))


def test_a_lookup_l3_cannot_extend_is_answered_inline() -> None:
    metrics = ServiceMetrics()
    metrics.page_size_tokens = PAGE
    cache = FakeCache(l3_may_extend=False)
    reply = lookup_ops(cache, metrics).lookup(
        cast(Session, None), p.Tokens(tokens=list(range(6 * PAGE)))
    )
    assert reply == {
        "page_size_tokens": PAGE,
        "tokens_l2": 2 * PAGE,
        "tokens_total": 2 * PAGE,
        "store_writing": False,
    }
    assert cache.discovered == []
    assert metrics.hit_tokens == {"l2": 2 * PAGE, "l3": 0, "miss": 4 * PAGE}


def test_a_lookup_l3_may_extend_is_a_later_that_asks_l3_first() -> None:
    metrics = ServiceMetrics()
    metrics.page_size_tokens = PAGE
    cache = FakeCache(l3_may_extend=True)
    tokens = list(range(6 * PAGE))
    later = lookup_ops(cache, metrics).lookup(cast(Session, None), p.Tokens(tokens=tokens))
    assert isinstance(later, Later)
    assert cache.discovered == []  # nothing asked of L3 and nothing counted before the await
    assert metrics.hit_tokens == {"l2": 0, "l3": 0, "miss": 0}
    reply = asyncio.run(cast(Any, later.run()))
    assert reply == {
        "page_size_tokens": PAGE,
        "tokens_l2": 2 * PAGE,
        "tokens_total": 4 * PAGE,
        "store_writing": False,
    }
    assert cache.discovered == [tokens]
    assert metrics.hit_tokens == {"l2": 2 * PAGE, "l3": 2 * PAGE, "miss": 2 * PAGE}


class _Transport:
    def get_extra_info(self, name: str) -> None:
        return None


def _decoded(reply: bytes) -> dict[str, Any]:
    return cast(dict[str, Any], msgpack.unpackb(reply[p.HEADER.size :]))


def test_answer_now_replies_inline_or_gives_what_to_await(tmp_path: Path) -> None:
    loaded = load_deployment(write_config(tmp_path))
    backend = CpuCopyBackend()
    try:
        server = EngineServer(
            sidecar_plan(loaded), backend, None, asyncio.TaskGroup(), ServiceMetrics()
        )
        session = server.open(cast(asyncio.Transport, _Transport()))
        assert session is not None
        assert server.sessions == {session.id: session}

        def body(message: dict[str, Any]) -> bytes:
            return p.frame(message)[p.HEADER.size :]

        early = server.answer_now(session, body({"op": "heartbeat", "id": 1}))
        assert isinstance(early, bytes)
        assert _decoded(early)["error"] == {
            "code": "not_ready",
            "message": "heartbeat: send hello first",
        }
        session.key = NamespaceKey(0, "")  # as hello leaves it
        beat = server.answer_now(session, body({"op": "heartbeat", "id": 2}))
        assert isinstance(beat, bytes)
        assert _decoded(beat)["id"] == 2
        assert _decoded(beat)["ok"] is True
        store = {"tokens": [1, 2], "device_pages": {}, "snapshots": {}}
        deferred = server.answer_now(session, body({"op": "store", "id": 3, "args": store}))
        assert callable(deferred)  # an awaited op: nothing of it ran yet
        reply = _decoded(asyncio.run(cast(Any, deferred())))
        assert reply["id"] == 3
        assert reply["error"] == {
            "code": "not_ready",
            "message": "store: send register_pools first",
        }
        assert session.in_request == 0
    finally:
        backend.close()
