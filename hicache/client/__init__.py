"""The engine client of the sidecar: `connect` (blocking, `engine`; `connect_deployment` for
the model a deployment file describes), `connect_async` (`aio`);
the handles and errors they return (`handle`); a prompt's page keys, computed once with the
sidecar's keyers (`keys`); what both share (`base`)."""

from hicache.channel.shm import SharedPools
from hicache.client.aio import AsyncClient, connect_async
from hicache.client.engine import Client, connect, connect_deployment
from hicache.client.handle import (
    ClientError,
    Epoch,
    LoadFailedError,
    LoadHandle,
    LoadLostError,
    Lookup,
    NoReplyError,
    SidecarUnreachableError,
)
from hicache.client.keys import KeySpec, PromptKeys

__all__ = [
    "AsyncClient",
    "Client",
    "ClientError",
    "Epoch",
    "KeySpec",
    "LoadFailedError",
    "LoadHandle",
    "LoadLostError",
    "Lookup",
    "NoReplyError",
    "PromptKeys",
    "SharedPools",
    "SidecarUnreachableError",
    "connect",
    "connect_async",
    "connect_deployment",
]
