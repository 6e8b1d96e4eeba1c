"""Where KV bytes live: the device-pool adapter (L1, the engine's tensors per cache group) and
the host tier (L2: one preallocated, prefaulted buffer per group with a page allocator and
pins). Never calls the CUDA API itself; pinning and device work go through
`hicache.transfer`."""

from hicache.memory.device_pool import DevicePool
from hicache.memory.geometry import CacheDtypes, GroupGeometry, group_geometries, torch_dtype
from hicache.memory.host_pool import HostPool, HostPoolStats
from hicache.memory.host_tier import HostTier, HostTierReport
from hicache.memory.page_allocator import PageAllocator

__all__ = [
    "CacheDtypes",
    "DevicePool",
    "GroupGeometry",
    "HostPool",
    "HostPoolStats",
    "HostTier",
    "HostTierReport",
    "PageAllocator",
    "group_geometries",
    "torch_dtype",
]
