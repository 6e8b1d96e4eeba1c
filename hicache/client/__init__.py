"""The engine client of the sidecar: `connect` (blocking, `engine`), `connect_async` (`aio`);
the handles and errors they return (`handle`); what both share (`base`)."""

from hicache.client.aio import AsyncClient, connect_async
from hicache.client.engine import Client, connect
from hicache.client.handle import ClientError, LoadFailedError, LoadHandle, LoadLostError, Lookup
from hicache.service.shm import SharedPools

__all__ = [
    "AsyncClient",
    "Client",
    "ClientError",
    "LoadFailedError",
    "LoadHandle",
    "LoadLostError",
    "Lookup",
    "SharedPools",
    "connect",
    "connect_async",
]
