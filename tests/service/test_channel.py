"""The engine channel's boundary against a real `hicache serve`: every bad request gets an
error reply naming what is wrong (tested message by message), a fuzzed frame gets an error
reply or a clean close, and the server answers a valid request afterwards."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.channel import protocol as p
from hicache.channel.counters import CounterFile
from hicache.client import ClientError, connect
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from tests.service.conftest import write_config


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, Path]]:
    tmp = tmp_path_factory.mktemp("channel")
    config = write_config(tmp, max_frame_bytes="64KiB")
    proc = SidecarProcess(config).start()
    try:
        yield proc, config
    finally:
        assert proc.stop() == 0


def raw(proc: SidecarProcess) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(proc.socket)
    return sock


def send(sock: socket.socket, body: bytes) -> None:
    sock.sendall(struct.pack("<I", len(body)) + body)


def recv(sock: socket.socket) -> Any:
    header = b""
    while len(header) < 4:
        chunk = sock.recv(4 - len(header))
        if not chunk:
            return None  # a clean close
        header += chunk
    (size,) = struct.unpack("<I", header)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        assert chunk, "the server closed mid-reply"
        body += chunk
    return msgpack.unpackb(body)


def ask(sock: socket.socket, message: Any) -> Any:
    send(sock, msgpack.packb(message))
    return recv(sock)


def client_for(config: Path, **kwargs: Any):  # type: ignore[no-untyped-def]
    loaded = load_deployment(config)
    d = loaded.deployment
    return connect(
        d.service.socket_path, loaded.layer_map(), page_size_tokens=16, heartbeat=False, **kwargs
    )


def error_of(reply: Any) -> tuple[str, str]:
    assert reply["ok"] is False, reply
    return reply["error"]["code"], reply["error"]["message"]


def test_requests_before_hello_and_unknown_ops(served: tuple[SidecarProcess, Path]) -> None:
    proc, _ = served
    with raw(proc) as sock:
        assert error_of(ask(sock, {"op": "lookup", "id": 1, "args": {"tokens": [1]}})) == (
            "not_ready",
            "lookup: send hello first",
        )
        code, message = error_of(ask(sock, {"op": "explode", "id": 2}))
        assert code == "unknown_op"
        assert message.startswith("op 'explode' is not known; allowed: heartbeat, hello, load")
        code, message = error_of(ask(sock, {"op": "lookup", "id": 3, "oops": 1}))
        assert (code, message) == (
            "bad_request",
            "unknown request fields ['oops']; allowed: op, id, args",
        )
        send(sock, b"\xc1not msgpack")
        code, message = error_of(recv(sock))
        assert (code, message) == (
            "bad_frame",
            "frame of 12 bytes is not valid msgpack (a byte that starts no msgpack value); it "
            "starts c1 6e 6f 74 20 6d 73 67 70 61 63 6b",
        )
        send(sock, msgpack.packb({"id": 4}) + b"\x01")
        assert error_of(recv(sock)) == (
            "bad_frame",
            "frame of 6 bytes is not valid msgpack (bytes after the first value; one request "
            "per frame); it starts 81 a2 69 64 04 01",
        )
        code, message = error_of(ask(sock, {"id": 5, "args": {}}))
        assert code == "bad_request"
        assert message.startswith("request 5 names no op; a request is {op, id, args} with op")
        assert error_of(ask(sock, {"op": 7, "id": 6})) == (
            "bad_request",
            "op must be a string (got int 7)",
        )
        send(sock, msgpack.packb({b"op": "lookup", "id": 7}, use_bin_type=True))
        assert error_of(recv(sock)) == (
            "bad_request",
            "request keys must be msgpack strings; got b'op' (pack with use_bin_type=True and "
            "str keys)",
        )


def test_argument_errors_name_field_value_and_rule(served: tuple[SidecarProcess, Path]) -> None:
    _, config = served
    with client_for(config) as client:
        with pytest.raises(ClientError) as info:
            client.call("lookup", {"tokens": [1, -5]})
        assert info.value.code == "bad_request"
        assert info.value.message == (
            "lookup.tokens.1: Input should be greater than or equal to 0 (got -5)"
        )
        with pytest.raises(ClientError) as info:
            client.call("lookup", {"tokens": "abc"})
        assert info.value.message == "lookup.tokens: Input should be a valid list (got 'abc')"
        with pytest.raises(ClientError) as info:
            client.call("store", {"tokens": [1] * 16, "device_pages": {"full": [0]}})
        assert info.value.message == "store: send register_pools first"


def test_oversized_frame_gets_an_error_then_close(served: tuple[SidecarProcess, Path]) -> None:
    proc, _ = served
    with raw(proc) as sock:
        sock.sendall(struct.pack("<I", 10 * 2**20))
        code, message = error_of(recv(sock))
        assert code == "bad_frame"
        assert message == (
            "frame of 10485760 bytes exceeds service.max_frame_bytes (65536); closing the "
            "connection"
        )
        assert recv(sock) is None


def test_hello_refusals_name_the_difference(served: tuple[SidecarProcess, Path]) -> None:
    proc, config = served
    with raw(proc) as sock:
        code, message = error_of(
            ask(sock, {"op": "hello", "id": 1, "args": {"protocol": 99, "layout": {}}})
        )
        assert (code, message) == (
            "refused",
            f"hello.protocol: engine speaks version 99; this sidecar speaks {p.PROTOCOL_VERSION}",
        )
    with pytest.raises(ClientError) as info:
        client_for(config, dtype="float16")
    assert info.value.code == "refused"
    assert info.value.message == (
        "hello.layout: the engine's KV layout differs from the sidecar's model; dtypes.conv: "
        "engine 'float16', sidecar 'bfloat16'; dtypes.full: engine 'float16', sidecar 'bfloat16'"
    )
    with pytest.raises(ClientError) as info:  # a state dtype of its own is a difference too
        client_for(config, state_dtype="float32")
    assert info.value.message == (
        "hello.layout: the engine's KV layout differs from the sidecar's model; dtypes.conv: "
        "engine 'float32', sidecar 'bfloat16'"
    )


def test_register_pools_and_page_range_errors(
    served: tuple[SidecarProcess, Path], tmp_path: Path
) -> None:
    _, config = served
    with client_for(config) as client:
        pools = client.create_pools(4)
        counters = CounterFile.create(int(client.session["load_slots"]))
        plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT)
        loose = os.memfd_create("unsealed")
        try:
            manifest = {**pools.manifest(), "counters_fd": counters.fd}
            bad = {**manifest, "nbytes": manifest["nbytes"] + 1}
            with pytest.raises(ClientError) as info:
                client.call("register_pools", bad)
            assert info.value.message == (
                f"register_pools.nbytes {manifest['nbytes'] + 1}: the tensors end at byte "
                f"{manifest['nbytes']} (4 KiB-aligned); allowed: exactly that"
            )
            os.ftruncate(plain, manifest["nbytes"])
            os.ftruncate(loose, manifest["nbytes"])
            pid = os.getpid()
            # files the engine could shrink under the sidecar
            with pytest.raises(ClientError) as info:
                client.call("register_pools", {**manifest, "fd": plain})
            assert info.value.message == (
                f"register_pools.fd: descriptor {plain} of engine pid {pid} is not a memfd "
                f"({str(tmp_path / 'plain')!r} is on another filesystem); create the pool with "
                "SharedPools.create"
            )
            with pytest.raises(ClientError) as info:
                client.call("register_pools", {**manifest, "fd": loose})
            assert info.value.message == (
                f"register_pools.fd: descriptor {loose} of engine pid {pid} is not sealed "
                "against shrinking (F_SEAL_SHRINK): a shrunk file would fault the sidecar; "
                "create it with SharedPools.create"
            )
            with pytest.raises(ClientError) as info:
                client.call("register_pools", {**manifest, "fd": 999_999})
            assert info.value.message.startswith(
                f"register_pools.fd: descriptor 999999 of engine pid {pid} cannot be opened (No "
                "such file or directory)"
            )
            with pytest.raises(ClientError) as info:
                client.call("register_pools", {**manifest, "counters_fd": loose})
            assert info.value.message.startswith(
                f"register_pools.counters_fd: descriptor {loose} of engine pid {pid} is not "
                "sealed against shrinking"
            )
            groups = {k: dict(v) for k, v in manifest["groups"].items()}
            groups["full"]["offsets"] = [list(o) for o in groups["full"]["offsets"]]
            groups["full"]["offsets"][1][0] = groups["full"]["offsets"][0][0]
            with pytest.raises(ClientError) as info:
                client.call("register_pools", {**manifest, "groups": groups})
            assert info.value.message.endswith("overlaps groups.full.offsets[0] (k)")
            gpu = {"uuid": "GPU-0", "pci_bus_id": "0000:3b:00.0", "index": 0}
            with pytest.raises(ClientError) as info:
                client.call(
                    "register_cuda_pools",
                    {"device": gpu, "groups": {}, "counters_fd": counters.fd},
                )
            assert info.value.code == "refused"
            assert info.value.message.startswith(
                "register_cuda_pools: this sidecar copies on CPU (device.kind: cpu)"
            )
            client.register_pools(pools)
            tokens = list(range(32))
            with pytest.raises(ClientError) as info:
                client.store(tokens, {"full": [0, 9]}, {"conv": {32: 0}})
            assert info.value.code == "out_of_range"
            assert info.value.message == (
                "store.device_pages.full: pages [9] are outside the registered pool of 4 "
                "pages (0..3)"
            )
            with pytest.raises(ClientError) as info:
                client.store(tokens, {"conv": [0]}, {})
            assert info.value.message == (
                "store.device_pages: groups ['full'] missing; every token group of the layout "
                "needs its pages"
            )
            with pytest.raises(ClientError) as info:
                client.store(tokens, {"full": [0, 1], "conv": [0]})
            assert info.value.message == (
                "store: device_pages.conv: 'conv' is a short-conv state group; a store gives "
                "its snapshots as snapshots={group: {num_tokens: slot}}, saying how many tokens "
                "each snapshot covers"
            )
            with pytest.raises(ClientError) as info:
                client.store(tokens, {"full": [0, 1]}, {"conv": {30: 0}})
            assert info.value.message == (
                "store: snapshots.conv: a snapshot after 30 tokens cannot be keyed; allowed: a "
                "multiple of the page size (16) in 16..32 (the prompt's full pages)"
            )
            # the session still works after every refusal
            assert client.store(tokens, {"full": [0, 1]}, {"conv": {32: 0}})["pages_stored"] == 3
            with pytest.raises(ClientError) as info:
                client.call("release", {"load_id": 12345})
            assert info.value.code == "out_of_range"
        finally:
            pools.close()
            counters.close()
            os.close(plain)
            os.close(loose)


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)
_requests = st.fixed_dictionaries(
    {"op": st.sampled_from([*p.ARGS, "nope"]), "id": st.integers(0, 2**31)},
    optional={"args": st.dictionaries(st.text(max_size=12), _values, max_size=6)},
)
_frames = st.one_of(
    _requests.map(lambda m: msgpack.packb(m)),
    _values.map(lambda v: msgpack.packb(v)),
    st.binary(max_size=64),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(frame=_frames)
def test_fuzzed_frames_get_an_error_or_a_clean_close(
    served: tuple[SidecarProcess, Path], frame: bytes
) -> None:
    proc, _ = served
    with raw(proc) as sock:
        send(sock, frame)
        reply = recv(sock)
        if reply is not None:
            assert set(reply) >= {"id", "ok"}
            if reply["ok"] is False:
                assert reply["error"]["code"] in vars(p.ErrorCode).values()
                assert reply["error"]["message"]
            # and the connection still answers a valid request
            assert ask(sock, {"op": "heartbeat", "id": 7})["id"] == 7
    with raw(proc) as sock:  # the server is up for everyone else
        assert ask(sock, {"op": "heartbeat", "id": 8})["error"]["code"] == "not_ready"


def test_a_capacity_race_is_busy_not_bad_request() -> None:
    """L2 pages pinned by copies in flight are a transient state, not the engine's mistake:
    busy (retry), not bad_request telling it to raise a capacity."""
    from hicache.errors import PoolExhaustedError
    from hicache.service.metrics import ServiceMetrics
    from hicache.service.server import EngineServer

    server = EngineServer.__new__(EngineServer)
    server.metrics = ServiceMetrics()
    exc = PoolExhaustedError("host pool 'full': 3 pages asked for, 0 of 8 free")
    reply = msgpack.unpackb(server._error_reply(None, 7, "store", exc)[p.HEADER.size :])  # type: ignore[arg-type]
    assert reply["error"] == {
        "code": "busy",
        "message": "store: no free L2 page now (host pool 'full': 3 pages asked for, 0 of 8 "
        "free); the rest are pinned by copies in flight: retry after they end (if this "
        "persists, raise host.capacity_bytes)",
    }
