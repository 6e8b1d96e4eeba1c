"""`Namespace`: one engine namespace's cache in the sidecar (a tensor-parallel rank and tenant):
its host tier, index and scheduler, outliving the engine sessions that attach to it.

Lifecycle: built on the first `register_pools` of its namespace -> its scheduler runs in a
task of the service's TaskGroup -> any number of engine sessions attach (each one's mapped
pools are a scheduler attachment under its session id: its loads copy into its own pools, its
stores back up from them, while the host tier, the index and L3 are the namespace's, shared)
and detach (`detach`: that session's ops are cancelled and awaited, its pools dropped; every
other session's ops go on; L2 pages and the index stay) -> `close` stops the scheduler after
the service drains (`close`: bounded by the drain's time left; a scheduler still running
then is cancelled, so the service's TaskGroup always ends). Which namespace a key has, and
its phase (starting, running, draining, closed), is `namespace_registry.NamespaceRegistry`'s:
there is never a second one of a key.

Each namespace copies on its pools' device: a TP rank's engine on GPU 3 gets host pools
registered and staging allocated by the sidecar's backend for GPU 3 (`for_device`), not the
one `device.index` names; every engine attaching to the namespace must bring pools on that
device (checked per attachment).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from hicache.assembly.sidecar import SidecarPlan
from hicache.cache import TieredCache
from hicache.memory import DevicePool
from hicache.storage import GuardedStore
from hicache.transfer import CopyBackend


@dataclass(frozen=True, slots=True)
class NamespaceKey:
    tp_rank: int
    tenant: str

    def __str__(self) -> str:
        return f"tp_rank={self.tp_rank} tenant={self.tenant!r}"


@dataclass
class Namespace:
    key: NamespaceKey
    cache: TieredCache
    attached: set[int] = field(default_factory=set)  # engine session ids attached now
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    @classmethod
    async def start(
        cls,
        key: NamespaceKey,
        plan: SidecarPlan,
        backend: CopyBackend,
        store: GuardedStore | None,
        device_pools: dict[str, DevicePool],
        tg: asyncio.TaskGroup,
    ) -> Namespace:
        # the namespace copies on its pools' device (a TP rank's GPU), whatever device.index
        # says: the sidecar's backend gives a sibling per device, closed with it
        cache = plan.namespace_cache(
            tenant=key.tenant,
            tp_rank=key.tp_rank,
            backend=backend,
            store=store,
            device_pools=device_pools,
        )
        # the first engine's pools built the stack; they are served as its attachment
        # (`attach`), not as the scheduler's default one, so they go when that engine does
        cache.drop_default_pools()
        namespace = cls(key, cache)
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        namespace._task = tg.create_task(namespace._run(started), name=f"hicache-ns-{key}")
        try:
            await asyncio.shield(started)
        except BaseException:  # cancelled while its scheduler starts: that task stops itself
            namespace._stop.set()
            raise
        return namespace

    async def _run(self, started: asyncio.Future[None]) -> None:
        try:
            async with self.cache.running():
                started.set_result(None)
                await self._stop.wait()
                await self.cache.drain()
        except Exception as exc:
            if started.done():
                raise
            started.set_exception(exc)  # the start's error, not the service's end

    def attach(self, session_id: int, device_pools: dict[str, DevicePool]) -> None:
        """Serve an engine session's pools beside the others attached; refused (ConfigError)
        when they are on another device than the one this namespace copies on (its host tier
        and streams stay where they are)."""
        self.cache.attach_device_pools(device_pools, attachment=session_id)
        self.attached.add(session_id)

    async def detach(self, session_id: int) -> int:
        """Drop one engine session's pools once its ops have ended (any still queued or in
        flight are cancelled and awaited: their pins go with them); other sessions' ops go
        on, L2 and the index stay. Returns how many of its ops were cancelled."""
        if session_id not in self.attached:
            return 0
        try:
            return await self.cache.end_attachment(session_id)
        finally:
            self.attached.discard(session_id)

    @property
    def l2_identity(self) -> int:
        """Which L2 this namespace's pages live in: its own, or (`tenants.shared_l2`) the one
        its rank's tenants share — so totals count a shared L2 once."""
        return id(self.cache.embedded.host_tier)

    @property
    def host_pools_bytes(self) -> int:
        """The L2 bytes this namespace's cached groups hold (a shared L2: all of it)."""
        return sum(self.cache.host_pool_stats(g).capacity_bytes for g in self.cache.index.rules)

    async def close(self, timeout_s: float | None = None) -> bool:
        """Stop the scheduler once its ops have ended; within `timeout_s` (None: no bound),
        else its task is cancelled (and awaited). False: it ran past `timeout_s`."""
        self._stop.set()
        if self._task is None:
            return True
        done, _ = await asyncio.wait([self._task], timeout=timeout_s)
        if done:
            self._task.result()
            return True
        self._task.cancel()
        await asyncio.wait([self._task])
        return False
