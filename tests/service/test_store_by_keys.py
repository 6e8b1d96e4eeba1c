"""Stores and loads by the engine's own page keys (`store_keys` / `load_keys`: an engine that
names pages itself, as SGLang's page hashes do, and sends no tokens) against a real
`hicache serve`: the bytes one engine stored by ids come back exact into another engine's
pool; a prefix of the ids hits as far as it was stored, a run of them starting mid-prompt hits
the same pages; ids under another tenant never hit;
a repeated store is idempotent; malformed requests are refused naming the field, the value
and what is allowed, and the session carries on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from hicache.client import Client, ClientError, connect
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment

PAGE = 16
MODEL = {
    "model_type": "tiny-dense",
    "page_size_tokens": PAGE,
    "layers": [{"kind": "full", "kv_heads": 2, "head_dim": 16}] * 2,
}


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, Path]]:
    tmp = tmp_path_factory.mktemp("keyed")
    data = {
        "model": MODEL,
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": "4MiB"},
        "storage": {"kind": "file", "path": str(tmp / "l3")},
        "service": {"socket_path": str(tmp / "k.sock"), "http_port": None},
    }
    config = tmp / "deploy.yaml"
    config.write_text(yaml.safe_dump(data))
    with SidecarProcess(config) as process:
        yield process, config


def engine(sidecar: tuple[SidecarProcess, Path], tenant: str = "sglang") -> Client:
    process, config = sidecar
    client = connect(
        process.socket, load_deployment(config).layer_map(), heartbeat=False, tenant=tenant
    )
    client.register_pools(client.create_pools(16))
    return client


def ids(n: int, salt: bytes = b"") -> list[bytes]:
    return [f"{i:064x}".encode() + salt for i in range(n)]


def test_bytes_stored_by_ids_load_exactly_into_another_engine(
    sidecar: tuple[SidecarProcess, Path],
) -> None:
    a, b = engine(sidecar), engine(sidecar)
    try:
        assert a.pools is not None
        assert b.pools is not None
        a.pools.buffer.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(1))
        group = next(iter(a.geometries))
        keys = a.key_spec().of_ids(ids(4, b"/bytes"))
        reply = a.store_keys(keys, {group: [3, 1, 4, 5]})
        assert reply["pages_stored"] == 4
        assert reply["truncated_to_tokens"] is None
        # idempotent: the same pages again store nothing new
        assert a.store_keys(keys, {group: [3, 1, 4, 5]})["pages_stored"] == 0
        assert b.lookup_keys(b.key_spec().of_ids(ids(4, b"/bytes"))).tokens_total == 4 * PAGE
        handle = b.load_keys(b.key_spec().of_ids(ids(4, b"/bytes")), {group: [0, 1, 2, 3]})
        assert handle is not None
        assert handle.tokens == 4 * PAGE
        assert handle.done() == "done"
        a_layers = a.pools.device_pools()[group].tensors
        b_layers = b.pools.device_pools()[group].tensors
        for a_layer, b_layer in zip(a_layers, b_layers, strict=True):
            for tensor in ("k", "v"):
                # compared as bytes: random bytes hold NaNs, which never equal
                rows_a = a_layer[tensor].reshape(16, -1).view(torch.uint8)
                rows_b = b_layer[tensor].reshape(16, -1).view(torch.uint8)
                for src, dst in zip([3, 1, 4, 5], [0, 1, 2, 3], strict=True):
                    assert torch.equal(rows_a[src], rows_b[dst])
        # a prefix hits as far as it was stored: 4 of 6
        longer = b.key_spec().of_ids(ids(4, b"/bytes") + ids(2, b"/never"))
        assert b.lookup_keys(longer).tokens_total == 4 * PAGE
        handle = b.load_keys(longer, {group: [6, 7, 8, 9, 10, 11]})
        assert handle is not None
        assert handle.tokens == 4 * PAGE
        assert handle.done() == "done"
    finally:
        a.close()
        b.close()


def test_a_run_starting_mid_prompt_hits_and_a_missing_page_ends_the_hit(
    sidecar: tuple[SidecarProcess, Path],
) -> None:
    """SGLang names a call's pages from wherever its device cache or tree node starts: the
    tail of a stored prompt is the same pages' keys (ids are unchained), so it hits and loads
    those bytes; an id never stored in the middle ends the hit there."""
    a, b = engine(sidecar), engine(sidecar)
    try:
        assert a.pools is not None
        assert b.pools is not None
        a.pools.buffer.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(2))
        group = next(iter(a.geometries))
        stored = ids(5, b"/tail")
        assert (
            a.store_keys(a.key_spec().of_ids(stored), {group: [5, 6, 7, 8, 9]})["pages_stored"] == 5
        )
        tail = b.key_spec().of_ids(stored[2:])
        assert b.lookup_keys(tail).tokens_total == 3 * PAGE
        handle = b.load_keys(tail, {group: [0, 1, 2]})
        assert handle is not None
        assert handle.tokens == 3 * PAGE
        assert handle.done() == "done"
        for a_layer, b_layer in zip(
            a.pools.device_pools()[group].tensors,
            b.pools.device_pools()[group].tensors,
            strict=True,
        ):
            for tensor in ("k", "v"):
                rows_a = a_layer[tensor].reshape(16, -1).view(torch.uint8)
                rows_b = b_layer[tensor].reshape(16, -1).view(torch.uint8)
                for src, dst in zip([7, 8, 9], [0, 1, 2], strict=True):
                    assert torch.equal(rows_a[src], rows_b[dst])
        holed = stored[:2] + ids(1, b"/hole") + stored[3:]
        assert b.lookup_keys(b.key_spec().of_ids(holed)).tokens_total == 2 * PAGE
    finally:
        a.close()
        b.close()


def test_ids_are_keys_of_their_namespace_only(sidecar: tuple[SidecarProcess, Path]) -> None:
    a, other = engine(sidecar), engine(sidecar, tenant="another")
    try:
        group = next(iter(a.geometries))
        a.store_keys(a.key_spec().of_ids(ids(2, b"/ns")), {group: [0, 1]})
        assert other.lookup_keys(other.key_spec().of_ids(ids(2, b"/ns"))).tokens_total == 0
        assert other.load_keys(other.key_spec().of_ids(ids(2, b"/ns")), {group: [0, 1]}) is None
        # ids never collide with token keys of the same namespace
        tokens = list(range(2 * PAGE))
        assert a.lookup(tokens).tokens_total == 0
    finally:
        a.close()
        other.close()


def test_malformed_keyed_requests_are_refused_naming_the_value(
    sidecar: tuple[SidecarProcess, Path],
) -> None:
    a = engine(sidecar)
    try:
        group = next(iter(a.geometries))
        blob = a.key_spec().of_ids(ids(3, b"/bad")).blobs[group]
        with pytest.raises(
            ClientError,
            match=r"store_keys\.device_pages\.\w+: 2 pages for 3 keys; give one device page per page key",
        ):
            a.call("store_keys", {"keys": {group: blob}, "device_pages": {group: [0, 1]}})
        with pytest.raises(
            ClientError,
            match=r"load_keys\.keys\.\w+: the engine sent 47 bytes, not a whole number of 16-byte page keys",
        ):
            a.call("load_keys", {"keys": {group: blob[:47]}, "device_pages": {group: [0, 1, 2]}})
        with pytest.raises(
            ClientError, match=r"store_keys\.keys: groups \['nope'\] are not cached here"
        ):
            a.call(
                "store_keys",
                {"keys": {group: blob, "nope": blob}, "device_pages": {group: [0, 1, 2]}},
            )
        with pytest.raises(
            ClientError,
            match=r"load_keys\.device_pages\.\w+: pages \[99\] are outside the registered pool of 16 pages",
        ):
            a.call("load_keys", {"keys": {group: blob}, "device_pages": {group: [0, 1, 99]}})
        # the session carries on
        assert (
            a.store_keys(a.key_spec().of_ids(ids(3, b"/bad")), {group: [0, 1, 2]})["pages_stored"]
            == 3
        )
    finally:
        a.close()


def test_a_stream_on_keyed_ops_needs_cuda_pools(sidecar: tuple[SidecarProcess, Path]) -> None:
    """`store_keys` / `load_keys` order CUDA work as `store` / `load` do (a fence from
    `stream`); with shared-memory pools a stream is refused by op name, nothing sent."""
    client = engine(sidecar)
    try:
        group = next(iter(client.geometries))
        keys = client.key_spec().of_ids(ids(1, b"/stream"))
        for op in ("store_keys", "load_keys"):
            with pytest.raises(
                ClientError, match=rf"^bad_request: {op}: a stream orders CUDA work; this client"
            ):
                getattr(client, op)(keys, {group: [0]}, stream=object())
        assert client.lookup_keys(keys).tokens_total == 0  # the refused store sent nothing
    finally:
        client.close()
