"""What an operator sees: the shutdown drain bounded by `service.drain_timeout_s` (a slow L3
cannot hold SIGTERM past it; what stayed unwritten is reported), a log line for every session
and every refusal, connect errors naming the address and the cause, and layout mismatches in
words."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from hicache import assembly
from hicache.channel import protocol as p
from hicache.channel.counters import CounterFile
from hicache.client import ClientError, SidecarUnreachableError, connect, connect_async
from hicache.client.base import parse_address
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from hicache.errors import ConfigError
from hicache.service import app
from hicache.storage import GuardedStore
from hicache.testing.faulty_storage import FaultyBackend
from tests.service.conftest import write_config
from tests.service.test_channel import ask, error_of, raw


@pytest.fixture
def hicache_logs() -> Iterator[None]:
    """`serve` points the hicache logger at the stderr of the moment: put it back after."""
    root = logging.getLogger("hicache")
    saved = root.handlers[:], root.level, root.propagate
    try:
        yield
    finally:
        root.handlers[:], root.level, root.propagate = saved


def fields_of(log: str, event: str) -> list[dict[str, str]]:
    """The `key=value` fields of each text log line whose event is `event`."""
    found = []
    for line in log.splitlines():
        m = re.match(r"\S+Z \w+\s+(.*)$", line)
        if m is None or not m.group(1).startswith(event + " "):
            continue
        rest = m.group(1)[len(event) :]
        found.append(dict(re.findall(r"(\w+)=(\S*)", rest)))
    return found


async def wait_for_socket(path: Path, task: asyncio.Task[int]) -> None:
    for _ in range(600):
        if task.done():
            task.result()
            raise AssertionError("serve ended before it listened")
        with socket.socket(socket.AF_UNIX) as probe, contextlib.suppress(OSError):
            probe.connect(str(path))
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"nothing listens on {path}")


@pytest.mark.asyncio
@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
async def test_sigterm_with_a_slow_l3_exits_within_the_drain_timeout_and_reports_the_rest(
    write_policy: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hicache_logs: None,
) -> None:
    drain_timeout_s = 1.5
    config = write_config(tmp_path, http_port=None, drain_timeout_s=drain_timeout_s)
    data = yaml.safe_load(config.read_text())
    # write-back: every stored page is owed to L3 at exit, for the flush to write; write-through:
    # the persist worker is still writing them when SIGTERM comes
    data["cache"]["write_policy"] = write_policy
    config.write_text(yaml.safe_dump(data))
    opened = app.open_store

    def slow_l3(loaded: object) -> GuardedStore | None:
        store = opened(loaded)  # type: ignore[arg-type]
        assert store is not None
        # one object per backend call, 0.4 s each: the 13 pages owed need > 5 s
        return GuardedStore(
            FaultyBackend(store.backend, latency_s=0.4), chunk_bytes=1, base_timeout_s=30
        )

    monkeypatch.setattr(app, "open_store", slow_l3)
    loaded = load_deployment(config)
    task = asyncio.create_task(app.serve(loaded))
    sock = tmp_path / "e.sock"
    await wait_for_socket(sock, task)
    client = await connect_async(sock, loaded.layer_map(), page_size_tokens=16, heartbeat=False)
    try:
        pools = client.create_pools(16)
        await client.register_pools(pools)
        stored = await client.store(
            list(range(12 * 16)), {"full": list(range(12))}, {"conv": {12 * 16: 0}}
        )
        assert stored["pages_stored"] == 13
        started = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)  # serve's handler: the drain begins
        assert await asyncio.wait_for(task, 30) == 0
        elapsed = time.monotonic() - started
    finally:
        with contextlib.suppress(Exception):
            await client.close()
    err = capsys.readouterr().err
    assert elapsed < drain_timeout_s + 1.5, f"the drain took {elapsed:.1f} s\n{err}"
    (stopped,) = fields_of(err, "stopped")
    assert int(stopped["pages_unflushed"]) > 0, err
    assert int(stopped["pages_flushed"]) + int(stopped["pages_unflushed"]) == 13, err
    assert int(stopped["bytes_unflushed"]) > 0, err


def test_sessions_and_every_refusal_are_logged_once_without_the_token(tmp_path: Path) -> None:
    config = write_config(tmp_path, token="s3cret-tok")
    loaded = load_deployment(config)
    sock = loaded.deployment.service.socket_path

    def client(**kwargs: object):  # type: ignore[no-untyped-def]
        return connect(sock, loaded.layer_map(), page_size_tokens=16, heartbeat=False, **kwargs)

    with SidecarProcess(config) as proc:
        with pytest.raises(ClientError, match=r"hello\.token"):
            client(token="wrong-guess")
        with raw(proc) as s:
            hello = {"protocol": 99, "layout": {}, "token": "s3cret-tok"}
            assert error_of(ask(s, {"op": "hello", "id": 1, "args": hello}))[0] == "refused"
        with pytest.raises(ClientError, match=r"hello\.layout"):
            client(token="s3cret-tok", dtype="float16")
        with client(token="s3cret-tok", tenant="acme", engine="e1") as engine:
            pools = engine.create_pools(4)
            counters = CounterFile.create(int(engine.session["load_slots"]))
            try:
                manifest = {**pools.manifest(), "counters_fd": counters.fd}
                with pytest.raises(ClientError, match=r"register_pools\.nbytes"):
                    engine.call("register_pools", {**manifest, "nbytes": manifest["nbytes"] + 1})
            finally:
                counters.close()
            session = engine.session["session"]
        deadline = time.monotonic() + 60  # bounds a hang only (#26: a busy machine)
        while time.monotonic() < deadline:
            log = proc.log_path.read_text()
            if any(f.get("session") == str(session) for f in fields_of(log, "session ended")):
                break
            time.sleep(0.05)
    log = proc.log_path.read_text()
    assert "s3cret-tok" not in log
    assert "wrong-guess" not in log
    refused = [line for line in log.splitlines() if " refused " in line]
    for reason in ("hello.token", "hello.protocol", "hello.layout", "register_pools.nbytes"):
        assert sum(reason in line for line in refused) == 1, (reason, log)
    assert len(refused) == 4, log
    (started,) = [f for f in fields_of(log, "session started") if f["session"] == str(session)]
    assert started["pid"] == str(os.getpid())
    assert (started["tp_rank"], started["tenant"], started["role"]) == ("0", "acme", "engine")
    (ended,) = [f for f in fields_of(log, "session ended") if f["session"] == str(session)]
    assert (ended["pid"], ended["tenant"]) == (str(os.getpid()), "acme")


def test_a_token_of_the_wrong_type_or_length_is_never_logged(tmp_path: Path) -> None:
    """A hello whose token fails validation (bytes, or over the length limit) is refused with
    a reason that never quotes it: a cut-off quote of a long token escaped the masking of
    the configured one."""
    secret = "a3f1" * 16  # 64 characters, as `openssl rand -hex 32` gives
    config = write_config(tmp_path, token=secret)
    with SidecarProcess(config) as proc:
        for token in (secret.encode(), secret * 70, secret[:40] + "x" * 30):
            with raw(proc) as s:
                hello = {"protocol": p.PROTOCOL_VERSION, "layout": {}, "token": token}
                _code, message = error_of(ask(s, {"op": "hello", "id": 1, "args": hello}))
                assert secret[:16] not in message
        time.sleep(0.3)
    log = proc.log_path.read_text()
    assert secret[:16] not in log
    assert " refused " in log


def test_connect_names_the_address_and_why(tmp_path: Path) -> None:
    layer_map = load_deployment(write_config(tmp_path)).layer_map()
    missing = tmp_path / "nobody.sock"
    with pytest.raises(SidecarUnreachableError) as info:
        connect(missing, layer_map, heartbeat=False)
    assert str(info.value) == (
        f"cannot connect to the sidecar at Unix socket {str(missing)!r}: no such file (is "
        "hicache serve running? the path is its service.socket_path)"
    )
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # a file, nobody listening: what a killed sidecar leaves
    with pytest.raises(SidecarUnreachableError, match=r"at Unix socket .*: connection refused"):
        connect(str(stale), layer_map, heartbeat=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        port = s.getsockname()[1]
        with pytest.raises(SidecarUnreachableError) as info:
            connect(f"127.0.0.1:{port}", layer_map, heartbeat=False)  # host:port is TCP
        assert str(info.value).startswith(
            f"cannot connect to the sidecar at tcp://127.0.0.1:{port}: connection refused"
        )
        with pytest.raises(SidecarUnreachableError, match=rf"tcp://127.0.0.1:{port}: conn"):
            asyncio.run(connect_async(f"tcp://127.0.0.1:{port}", layer_map, heartbeat=False))
    with pytest.raises(SidecarUnreachableError, match="no such file"):
        asyncio.run(connect_async(missing, layer_map, heartbeat=False))
    with pytest.raises(ConfigError) as config_info:
        connect("localhost:http", layer_map, heartbeat=False)
    assert str(config_info.value) == (
        "sidecar address 'localhost:http': 'http' is not a TCP port (1-65535), and a Unix "
        "socket path needs a '/'; write a Unix socket as a path (/run/hicache/engine.sock, "
        "./engine.sock) and TCP as tcp://host:port (or host:port; IPv6 as [::1]:port)"
    )


def test_addresses_are_unix_paths_or_tcp_never_a_guess() -> None:
    assert parse_address("127.0.0.1:9") == (socket.AF_INET, ("127.0.0.1", 9))
    assert parse_address("tcp://:7000") == (socket.AF_INET, ("127.0.0.1", 7000))
    assert parse_address("tcp://[::1]:7000") == (socket.AF_INET6, ("::1", 7000))
    assert parse_address("engine.sock") == (socket.AF_UNIX, "engine.sock")
    assert parse_address("./a:9") == (socket.AF_UNIX, "./a:9")
    assert parse_address("unix://a:9") == (socket.AF_UNIX, "a:9")
    assert parse_address(Path("a:9")) == (socket.AF_UNIX, "a:9")
    assert parse_address("localhost:9") == (socket.AF_INET, ("localhost", 9))
    assert parse_address("tcp://hicache:9400") == (socket.AF_INET, ("hicache", 9400))
    for bad in ("", "::1:9", "http://host:9", "host:0", "host:", "127.0.0.1:0"):
        with pytest.raises(ConfigError, match="write a Unix socket as a path"):
            parse_address(bad)
    # a name:port could be a host or a file of that name (compose names hosts like files)
    with pytest.raises(ConfigError, match=r"ambiguous: write tcp://hicache:9400 .* \./hicache"):
        parse_address("hicache:9400")


def test_layout_mismatches_read_as_words(tmp_path: Path) -> None:
    loaded = load_deployment(write_config(tmp_path))
    layer_map = loaded.layer_map()
    geometries = assembly.geometries(loaded.deployment, layer_map)
    ours = p.layout_summary(layer_map, geometries, 16)
    theirs = p.layout_summary(layer_map, geometries, 16)
    theirs["groups"]["full"] = {**theirs["groups"]["full"], "kv_heads": 4}
    del theirs["groups"]["conv"]
    assert p.layout_differences(theirs, ours) == [
        "group 'conv': engine has no such group; sidecar has short-conv, state conv 1024x2, "
        "10 layers (0-1, 3-4, 6-7, 9, 11, 13, 15)",
        "group 'full': engine has full-attention, 4 KV heads x 64, 6 layers (2, 5, 8, 10, 12, "
        "14); sidecar has full-attention, 8 KV heads x 64, 6 layers (2, 5, 8, 10, 12, 14)",
    ]
    sliding = {"kind": "sliding", "kv_format": "mha", "kv_heads": 8, "head_dim": 64}
    sliding |= {"v_head_dim": 64, "window_tokens": 128, "layers": list(range(24))}
    assert p.describe_group(sliding) == (
        "sliding-window (window 128), 8 KV heads x 64, 24 layers (0-23)"
    )
    mla = {"kind": "full", "kv_format": "mla", "kv_heads": 1, "head_dim": 576}
    assert p.describe_group({**mla, "v_head_dim": None, "layers": [3]}) == (
        "full-attention, MLA latent 576, 1 layers (3)"
    )
