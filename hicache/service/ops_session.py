"""`SessionOps`: a session's own ops — `hello` (version, token, tensor parallelism, layout;
the namespace it will use and the keyer roots of its page keys), `heartbeat` (the engine's
reported layer stalls) and `stats` (its namespace's and L3's snapshot) — over the server's
explicit state (`ServerState`).

`hello` comes first in every session; `heartbeat` and `stats` are answered inline."""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from hicache.cache.keyers import page_keyers
from hicache.channel import protocol as p
from hicache.service.namespaces import NamespaceKey
from hicache.service.sessions import Session
from hicache.service.snapshots import namespace_stats, store_stats
from hicache.service.state import ServerState

log = logging.getLogger("hicache.service")


class SessionOps:
    def __init__(self, state: ServerState):
        self.state = state

    async def hello(self, session: Session, args: p.Hello) -> dict[str, Any]:
        if session.key is not None:
            raise p.RequestError(p.ErrorCode.REFUSED, "hello: this session already said hello")
        if args.protocol != p.PROTOCOL_VERSION:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"hello.protocol: engine speaks version {args.protocol}; this sidecar speaks "
                f"{p.PROTOCOL_VERSION}",
            )
        secret = self.state.service.token
        if secret is not None and not hmac.compare_digest(
            (args.token or "").encode(), secret.get_secret_value().encode()
        ):
            raise p.RequestError(
                p.ErrorCode.REFUSED, "hello.token: missing or wrong (service.token is set)"
            )
        self._check_tp(args)
        diffs = p.layout_differences(args.layout, self.state.layout)
        if diffs:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                "hello.layout: the engine's KV layout differs from the sidecar's model; "
                + "; ".join(diffs),
            )
        # any number of engine sessions share a namespace (replicas of one model side by
        # side): each registers its own pools; the index, L2 and L3 are the namespace's
        key = NamespaceKey(args.tp_rank, args.tenant)
        session.key, session.engine, session.pid = key, args.engine, args.pid
        session.lookup_only = args.role == "lookup"
        log.info(
            "session started",
            extra={
                "fields": {
                    "session": session.id,
                    "pid": session.peer_pid or args.pid or None,
                    "tp_rank": args.tp_rank,
                    "tenant": args.tenant,
                    "role": args.role,
                    "engine": args.engine or None,
                    "transport": "unix" if session.unix else "tcp",
                }
            },
        )
        return {
            "session": session.id,
            "protocol": p.PROTOCOL_VERSION,
            "heartbeat_timeout_s": self.state.service.heartbeat_timeout_s,
            "load_slots": self.state.service.load_slots,
            "keys": self._key_spec(key),
            "tp_size": self.state.layer_map.layout.tp_size,
            # stored once in L3 (by rank 0) and served to every rank (none at tp_size 1)
            "replicated_groups": [
                g.name
                for g in self.state.layer_map.groups
                if g.replicated and self.state.layer_map.layout.tp_size > 1
            ],
        }

    def _check_tp(self, args: p.Hello) -> None:
        """The engine's tensor-parallel size is the deployment's, its rank one of them."""
        ours = self.state.plan.tp_size
        if args.tp_size != ours:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"hello.tp_size: the engine runs tensor-parallel size {args.tp_size}; this "
                f"sidecar serves model.tp_size = {ours} (each rank's share of the KV heads "
                "differs by size); allowed: the same tp_size on both sides",
            )
        if args.tp_size > 1 and args.tp_rank >= args.tp_size:  # tp_size 1: see check_tp_rank
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"hello.tp_rank: {args.tp_rank} is not a rank of tp_size {args.tp_size} "
                f"(model.tp_size = {ours}); allowed: 0..{args.tp_size - 1}",
            )

    def _key_spec(self, key: NamespaceKey) -> dict[str, Any]:
        """What an engine needs to compute its namespace's page keys itself (`lookup_keys`):
        each cached group's keyer root, the page size, the algorithm."""
        namespace = self.state.namespaces.get(key)
        if namespace is not None:
            roots = namespace.cache.key_roots()
        else:  # no cache yet: the keyers it will have (Namespace.start builds them alike)
            keyers = page_keyers(
                self.state.geometries,
                self.state.layer_map,
                self.state.plan.move_policy,
                model=self.state.model_name,
                tenant_salt=self.state.plan.key_salt(key.tenant),
                tp_rank=key.tp_rank,
                key_algorithm=self.state.plan.key_algorithm,
            )
            roots = {group: keyer.root for group, keyer in keyers.items()}
        return {
            "algorithm": self.state.plan.key_algorithm,
            "page_size_tokens": self.state.plan.page_size_tokens,
            "roots": roots,
        }

    def stats(self, session: Session, args: p.Empty) -> dict[str, Any]:
        namespace = self.state.readable(session, "stats")
        if namespace is None:
            raise p.RequestError(
                p.ErrorCode.NOT_READY,
                f"stats: no engine has registered pools for namespace {session.key} yet",
            )
        return {**namespace_stats(namespace), "l3": store_stats(self.state.store)}

    def heartbeat(self, session: Session, args: p.Heartbeat) -> dict[str, Any]:
        for stall in args.layer_stall_s:
            self.state.metrics.layer_stall.observe(stall)
        self.state.metrics.starved(args.loads_starved)
        return {"now": time.time()}
