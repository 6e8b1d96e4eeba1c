"""A hybrid model's state snapshots by the engine's own page keys, each pool on its own, against
a real `hicache serve` — what SGLang's storage backend needs for its side pools (v2): a state
stored alone under the key of the page it follows (`store_keys` with the token group's pages
None and `snapshots`), the pages each group holds (`lookup_keys` with `served`: the full
group's run, the state group's snapshots), a lookup and a load of one group alone
(`groups`: the KV leading run without the state; the state of one trailing key without KV),
byte-exact into another engine's pool; malformed requests refused naming the field and what
is allowed, and the session carries on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from hicache.client import Client, ClientError, PromptKeys, connect
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment

PAGE = 16
MODEL = {
    "model_type": "tiny-hybrid",
    "layers": [
        {"kind": "linear", "state_shapes": {"conv": [8, 3], "recurrent": [2, 8, 8]}},
        {"kind": "full", "kv_heads": 2, "head_dim": 16},
    ],
}
FULL, STATE = "full", "linear"


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, Path]]:
    tmp = tmp_path_factory.mktemp("state-keys")
    data = {
        "model": {**MODEL, "page_size_tokens": PAGE},
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": "4MiB"},
        "storage": {"kind": "file", "path": str(tmp / "l3")},
        "service": {"socket_path": str(tmp / "s.sock"), "http_port": None},
    }
    config = tmp / "deploy.yaml"
    config.write_text(yaml.safe_dump(data))
    with SidecarProcess(config) as process:
        yield process, config


def engine(sidecar: tuple[SidecarProcess, Path], seed: int) -> Client:
    process, config = sidecar
    client = connect(
        process.socket, load_deployment(config).layer_map(), heartbeat=False, tenant="sglang"
    )
    client.register_pools(client.create_pools(16))
    assert client.pools is not None
    client.pools.buffer.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    assert set(client.geometries) == {FULL, STATE}
    return client


def ids(n: int, salt: bytes) -> list[bytes]:
    return [f"{i:064x}".encode() + salt for i in range(n)]


def rows(client: Client, group: str, page: int) -> list[torch.Tensor]:
    """Every layer's bytes of one page (a state group: one snapshot slot)."""
    assert client.pools is not None
    out = []
    for layer in client.pools.device_pools()[group].tensors:
        for tensor in layer.values():
            pages = client.pools.num_pages[group]
            out.append(tensor.reshape(pages, -1).view(torch.uint8)[page].clone())
    return out


def served(
    client: Client, keys: PromptKeys, groups: list[str] | None = None
) -> dict[str, list[int]]:
    """The pages each group holds, as prefix lengths, listed."""
    got = client.served_keys(keys, groups)
    return {group: s.lengths(keys.pages) for group, s in got.items()}


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_states_stored_alone_are_served_at_their_lengths_and_load_alone(
    sidecar: tuple[SidecarProcess, Path],
) -> None:
    a, b = engine(sidecar, 1), engine(sidecar, 2)
    try:
        stored = ids(4, b"/state")
        # the KV pages first (SGLang's batch_set_v1), without any state
        kv = a.key_spec().of_ids(stored)
        assert a.store_keys(kv, {FULL: [3, 1, 4, 5]})["pages_stored"] == 4
        spec = b.key_spec()
        assert served(b, spec.of_ids(stored)) == {FULL: [1, 2, 3, 4], STATE: []}
        # every group: no state, no hit; the KV group alone: its whole run
        assert b.lookup_keys(spec.of_ids(stored)).tokens_total == 0
        assert b.lookup_keys(spec.of_ids(stored), groups=[FULL]).tokens_total == 4 * PAGE
        # the states after 2 and after 4 pages, each stored alone under its trailing key
        for n, slot in ((2, 7), (4, 9)):
            reply = a.store_keys(
                a.key_spec().of_ids(stored[:n]), {FULL: [None] * n}, {STATE: {n * PAGE: slot}}
            )
            assert reply["pages_stored"] == 1, reply
        # idempotent: the same state again stores nothing new
        again = a.store_keys(a.key_spec().of_ids(stored[:4]), {FULL: [None] * 4}, {STATE: {64: 9}})
        assert again["pages_stored"] == 0
        longer = spec.of_ids(stored + ids(2, b"/never"))
        assert served(b, longer) == {FULL: [1, 2, 3, 4], STATE: [2, 4]}
        assert served(b, longer, [STATE]) == {STATE: [2, 4]}
        assert b.lookup_keys(longer).tokens_total == 4 * PAGE
        # the state after 2 pages alone, by its one trailing key, into b's slot 0
        handle = b.load_keys(spec.of_ids(stored[1:2]), {STATE: [0]}, groups=[STATE])
        assert handle is not None
        assert handle.done() == "done"
        assert same(rows(b, STATE, 0), rows(a, STATE, 7))
        # the KV run alone (no state asked for), into b's pages 8..11
        handle = b.load_keys(spec.of_ids(stored), {FULL: [8, 9, 10, 11]}, groups=[FULL])
        assert handle is not None
        assert handle.tokens == 4 * PAGE
        assert handle.done() == "done"
        for src, dst in zip([3, 1, 4, 5], [8, 9, 10, 11], strict=True):
            assert same(rows(b, FULL, dst), rows(a, FULL, src))
        # a trailing key no state was stored under: nothing loads
        assert b.load_keys(spec.of_ids(stored[2:3]), {STATE: [1]}, groups=[STATE]) is None
    finally:
        a.close()
        b.close()


def test_one_group_requests_are_checked_and_the_session_carries_on(
    sidecar: tuple[SidecarProcess, Path],
) -> None:
    a = engine(sidecar, 3)
    try:
        keys = a.key_spec().of_ids(ids(2, b"/bad"))
        with pytest.raises(ClientError, match=r"lookup_keys\.groups: \['attn'\] names groups"):
            a.lookup_keys(keys, groups=["attn"])
        with pytest.raises(ClientError, match=r"load_keys\.groups: .* repeats a group"):
            a.load_keys(keys, {STATE: [0]}, groups=[STATE, STATE])
        with pytest.raises(ClientError, match=r"load_keys\.device_pages: groups \['linear'\]"):
            a.load_keys(keys, {FULL: [0, 1]}, groups=[STATE])
        with pytest.raises(ClientError, match=r"snapshots\.linear: a snapshot after 48 tokens"):
            a.store_keys(keys, {FULL: [None, None]}, {STATE: {48: 0}})
        with pytest.raises(ClientError, match=r"store_keys\.snapshots\.linear\.*: pages \[99\]"):
            a.store_keys(keys, {FULL: [None, None]}, {STATE: {32: 99}})
        # nothing was stored by the refused requests; the session still serves
        assert served(a, keys) == {FULL: [], STATE: []}
        assert a.store_keys(keys, {FULL: [0, 1]}, {STATE: {32: 2}})["pages_stored"] == 3
        assert a.lookup_keys(keys).tokens_total == 2 * PAGE
    finally:
        a.close()
