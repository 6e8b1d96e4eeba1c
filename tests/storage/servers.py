"""Test wrappers over hicache.testing.local_servers: a missing server skips locally and fails
in CI (where .ci/run installs it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, TypeVar

import pytest

from hicache.testing import local_servers

# the redis client is an extra (hicache[redis], in [dev]); without it its tests skip, saying so
REDIS_CLIENT = "the redis client is not installed (pip install 'hicache[redis]')"


def _unavailable(name: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{name} is not installed; .ci/run must install it")
    pytest.skip(f"{name} is not installed")


def RedisServer(workdir: Path) -> local_servers.RedisServer:
    try:
        return local_servers.RedisServer(workdir)
    except FileNotFoundError:
        _unavailable("redis-server")
        raise


def RedisClusterServers(workdir: Path) -> local_servers.RedisClusterServers:
    try:
        return local_servers.RedisClusterServers(workdir)
    except FileNotFoundError as exc:
        _unavailable(str(exc).split()[0])  # redis-server or redis-cli
        raise


def MooncakeMaster() -> local_servers.MooncakeMaster:
    try:
        return local_servers.MooncakeMaster()
    except FileNotFoundError:
        _unavailable("mooncake_master")
        raise


def MooncakeSegmentHolder(
    master: local_servers.MooncakeMaster, segment_bytes: int = 256 << 20
) -> local_servers.MooncakeSegmentHolder:
    try:
        return local_servers.MooncakeSegmentHolder(master, segment_bytes=segment_bytes)
    except FileNotFoundError:
        _unavailable("mooncake_client")
        raise


class _Startable(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


S = TypeVar("S", bound=_Startable)


@contextmanager
def started(server: S) -> Iterator[S]:
    """`server` started for the block, stopped after it (a fixture's whole life)."""
    server.start()
    try:
        yield server
    finally:
        server.stop()
