"""`Namespace`: one engine namespace's cache in the sidecar (a tensor-parallel rank and tenant):
its host tier, index and scheduler, outliving the engine sessions that attach to it.

Lifecycle: built on the first `register_pools` of its namespace (the engine's mapped pools
are the scheduler's device pools) -> its scheduler runs in a task of the service's TaskGroup ->
an engine attaches (at most one at a time) and detaches (its device pools are dropped once its
ops have ended; L2 pages and the index stay for the next engine of the namespace) -> `close`
stops the scheduler after the service drains.

Each namespace copies on its pools' device: a TP rank's engine on GPU 3 gets host pools
registered and staging allocated by the sidecar's backend for GPU 3 (`for_device`), not the
one `device.index` names; a later engine of the namespace must bring pools on that device.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from hicache.assembly.sidecar import SidecarPlan
from hicache.cache import TieredCache
from hicache.embedded import check_pools_device
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
    owner: int | None = None  # session id attached now
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
        namespace = cls(key, cache)
        started = asyncio.Event()
        namespace._task = tg.create_task(namespace._run(started), name=f"hicache-ns-{key}")
        await started.wait()
        return namespace

    async def _run(self, started: asyncio.Event) -> None:
        async with self.cache.running():
            started.set()
            await self._stop.wait()
            await self.cache.drain()

    def attach(self, session_id: int, device_pools: dict[str, DevicePool]) -> None:
        """Serve an engine's pools; refused (ConfigError) when they are on another device
        than the one this namespace copies on (its host tier and streams stay where they are)."""
        check_pools_device(device_pools, self.cache.embedded.backend)
        self.cache.embedded.scheduler.attach_device_pools(device_pools)
        self.cache.embedded.device_pools = dict(device_pools)
        self.owner = session_id

    def detach(self) -> None:
        """Drop the engine's pools (its ops have ended); L2 and the index stay."""
        self.cache.embedded.scheduler.detach_device_pools()
        self.cache.embedded.device_pools = {}
        self.owner = None

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
