"""The engine client of the sidecar (`connect`, `connect_async`); see `engine` for the API."""

from hicache.client.engine import (
    AsyncClient,
    Client,
    ClientError,
    LoadFailedError,
    LoadHandle,
    LoadLostError,
    Lookup,
    connect,
    connect_async,
)
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
