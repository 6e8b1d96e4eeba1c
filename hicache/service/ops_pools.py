"""`PoolOps`: an engine session's pool registration — `register_pools` (the CPU data plane:
its pool and load counters are sealed memfds of its own, taken from the Unix socket's peer
process and mapped) and `register_cuda_pools` (the CUDA data plane: IPC handles) — then the
attachment of those pools to the session's namespace, started on its first registration, over
the server's explicit state (`ServerState`). Which namespace a key has is the registry's
(`state.registry`, namespace_registry.py): one per key, however many register at once.

Lifecycle: after `hello`, once per session; the session's end detaches what this attached
(`EngineServer.end`). The memory it names is claimed first (`claims.claim`): memory another
unended session holds — this process's included — is waited for or refused by identity. The
reply names the session (`session`: the epoch the engine's later replies carry)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache.channel import protocol as p
from hicache.channel.counters import CounterFile
from hicache.channel.shm import map_pools
from hicache.errors import HicacheError
from hicache.memory import DevicePool
from hicache.service.checkpoints import checkpoint
from hicache.service.claims import claim
from hicache.service.sessions import MemoryId, Prefaulting, Session, same_process
from hicache.service.state import ServerState


class PoolOps:
    def __init__(self, state: ServerState):
        self.state = state

    async def register_pools(self, session: Session, args: p.RegisterPools) -> dict[str, Any]:
        """The CPU data plane: the engine's pool is a sealed memfd of its own we map."""
        if self.state.plan.device_kind != "cpu":
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                "register_pools: this sidecar copies on CUDA (device.kind: cuda); export the "
                "engine's CUDA pools with register_cuda_pools",
            )
        self._check_unregistered(session, "register_pools")
        pid = self._peer_pid(session, "register_pools")
        try:
            pools, memory = map_pools(
                args.model_dump(), self.state.geometries, pid, self._alive(session)
            )
        except HicacheError as exc:
            raise p.RequestError(p.ErrorCode.BAD_REQUEST, f"register_pools.{exc}") from None
        reply = await self._attach(
            session, pools, pid, args.counters_fd, "register_pools", [memory.identity]
        )
        if memory.allocated:  # off the loop, after the reply: the session's end stops it
            session.prefault = Prefaulting.start(
                self.state.tg, self.state.prefaults, memory, session.id, pid
            )
        return reply

    @staticmethod
    def _alive(session: Session) -> Callable[[], bool]:
        assert session.peer_pid is not None
        pid, start = session.peer_pid, session.peer_start
        return lambda: same_process(pid, start)

    def _peer_pid(self, session: Session, op: str) -> int:
        """The engine process as the kernel names it: shared memory is only ever taken from
        the process on the other end of this session's Unix socket."""
        if not session.unix:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"{op}: this session came over TCP; shared memory is registered only over the "
                f"Unix socket ({self.state.service.socket_path}), whose peer the kernel names, so "
                "that no session can register another process's memory",
            )
        if session.peer_pid is None:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"{op}: the engine is outside the sidecar's pid namespace (the kernel names "
                "its pid 0), so its memory cannot be taken from it; run it in the sidecar's "
                'pid namespace (compose: pid: "service:<sidecar>"; docker: --pid '
                "container:<sidecar>)",
            )
        if not same_process(session.peer_pid, session.peer_start):
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"{op}: the process that connected (pid {session.peer_pid}) has exited; its "
                "pid may be another's now: connect from the process that holds the pool",
            )
        return session.peer_pid

    async def register_cuda_pools(
        self, session: Session, args: p.RegisterCudaPools
    ) -> dict[str, Any]:
        """The CUDA data plane: the engine's pool tensors arrive as CUDA IPC handles."""
        if self.state.plan.device_kind != "cuda":
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                "register_cuda_pools: this sidecar copies on CPU (device.kind: cpu); share the "
                "pool through shared memory with register_pools, or run the sidecar with "
                "device.kind: cuda",
            )
        self._check_unregistered(session, "register_cuda_pools")
        from hicache.transfer.cuda_ipc import map_cuda_pools  # CUDA only when used

        pid = self._peer_pid(session, "register_cuda_pools")
        try:
            pools = map_cuda_pools(args.model_dump(), self.state.geometries)
        except HicacheError as exc:
            raise p.RequestError(p.ErrorCode.BAD_REQUEST, f"register_cuda_pools.{exc}") from None
        return await self._attach(
            session, pools, pid, args.counters_fd, "register_cuda_pools", cuda_memory(args)
        )

    def _check_unregistered(self, session: Session, op: str) -> None:
        if session.lookup_only:
            raise p.RequestError(
                p.ErrorCode.REFUSED,
                f"{op}: this session said hello with role 'lookup'; only an 'engine' session "
                "registers pools, stores and loads",
            )
        if session.pools is not None:
            raise p.RequestError(p.ErrorCode.REFUSED, f"{op}: pools already registered")

    async def _attach(
        self,
        session: Session,
        pools: dict[str, DevicePool],
        pid: int,
        counters_fd: int,
        op: str,
        memory: list[MemoryId],
    ) -> dict[str, Any]:
        assert session.key is not None
        try:
            counters, identity = CounterFile.of_peer(
                pid, counters_fd, self.state.service.load_slots, self._alive(session)
            )
        except HicacheError as exc:
            raise p.RequestError(p.ErrorCode.BAD_REQUEST, f"{op}.{exc}") from None
        memory = [*memory, identity]
        if len(set(memory)) < len(memory):
            raise p.RequestError(
                p.ErrorCode.BAD_REQUEST,
                f"{op}.counters_fd: the counters are the pool's own memory; give each its memfd",
            )
        # claimed before the namespace's await (a racing claim sees it), once no other
        # session holds it: not even an unended one of this process (claims.py)
        await claim(
            self.state.sessions,
            session,
            memory,
            op,
            heartbeat_timeout_s=self.state.service.heartbeat_timeout_s,
        )
        try:
            # the key's one namespace: started by its first registration, awaited by the
            # others arriving meanwhile (namespace_registry.py); KV events watch its index
            # from its start (ServerState._start_namespace)
            namespace = await self.state.registry.namespace_for(session.key, session.id, pools, op)
            namespace.attach(session.id, pools)
        except BaseException:
            session.memory = []
            raise
        session.namespace, session.pools, session.counters = namespace, pools, counters
        session.free_slots = list(range(self.state.service.load_slots - 1, -1, -1))
        await checkpoint("attach.attached")
        return {"slots": counters.slots, "session": session.id}


def cuda_memory(args: p.RegisterCudaPools) -> list[MemoryId]:
    """What names a CUDA registration's memory: each allocation its tensors live in (the IPC
    handle of the allocation, which every export of it gives alike), once."""
    named = {
        ("cuda", tensor.device, tensor.handle)
        for group in args.groups.values()
        for layer in group.tensors
        for tensor in layer
    }
    return sorted(named, key=repr)
