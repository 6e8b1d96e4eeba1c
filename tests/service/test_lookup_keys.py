"""Lookups by page keys against real `hicache serve` processes: `lookup_keys` and
`lookup_many` answer exactly as the token lookup on hybrid layouts (gpt-oss's sliding + full,
LFM2's conv state + full) for random prompts after random stores; malformed key blobs are
refused naming the value, where it came from and what is allowed; keys of another namespace
(tenant, a forged root) never hit; discovery still finds in L3 what a restarted sidecar's
index does not know; the hello's roots are the namespace's own."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.channel import protocol as p
from hicache.client import Client, ClientError, KeySpec, connect, connect_async
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from hicache.index import KEY_BYTES
from tests.conftest import shared_model

PAGE = 16
GPT_OSS_PATTERN = {
    "model_type": "gpt-oss-pattern",
    "page_size_tokens": PAGE,
    "layers": [
        {"kind": "sliding", "kv_heads": 1, "head_dim": 16, "window_tokens": 48},
        {"kind": "full", "kv_heads": 1, "head_dim": 16},
    ],
}
LFM2 = {"config_path": str(shared_model("lfm2_350m.json")), "page_size_tokens": PAGE}


def write(tmp_path: Path, model: dict[str, Any], storage: dict[str, Any]) -> Path:
    data = {
        "model": model,
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": "4MiB"},
        "storage": storage,
        "service": {"socket_path": str(tmp_path / "k.sock"), "http_port": None},
    }
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def lfm2_file_l3(tmp_path: Path) -> Path:
    return write(tmp_path, LFM2, {"kind": "file", "path": str(tmp_path / "l3")})


@pytest.fixture
def served(lfm2_file_l3: Path) -> Iterator[SidecarProcess]:
    with SidecarProcess(lfm2_file_l3) as sidecar:
        yield sidecar


def client_of(sidecar: SidecarProcess, config: Path, **kwargs: Any) -> Client:
    return connect(sidecar.socket, load_deployment(config).layer_map(), heartbeat=False, **kwargs)


def store(client: Client, tokens: list[int], rng: random.Random, pool_pages: int) -> None:
    """Store the prompt's full pages (some sliding pages freed, as vLLM frees them), each
    state group's snapshot after them."""
    pages = len(tokens) // PAGE
    device: dict[str, list[int | None]] = {}
    snapshots: dict[str, dict[int, int]] = {}
    for group in client.layer_map.groups:
        if group.kind.is_token_cache:
            held: list[int | None] = list(rng.sample(range(pool_pages), pages))
            if group.spec.window_tokens is not None:  # out-of-window pages may be gone
                held = [None if rng.random() < 0.3 else page for page in held]
            device[group.name] = held
        elif pages:
            snapshots[group.name] = {pages * PAGE: rng.randrange(pool_pages)}
    client.store(tokens, device, snapshots)


def prompts(rng: random.Random) -> list[list[int]]:
    system = [rng.randrange(50_000) for _ in range(3 * PAGE)]
    out = [system + [rng.randrange(50_000) for _ in range(9 * PAGE)] for _ in range(4)]
    return [*out, [rng.randrange(50_000) for _ in range(12 * PAGE)]]


@pytest.mark.parametrize("layout", ["gpt-oss", "lfm2"])
def test_key_lookups_answer_as_token_lookups(tmp_path: Path, layout: str) -> None:
    config = write(tmp_path, GPT_OSS_PATTERN if layout == "gpt-oss" else LFM2, {"kind": "none"})
    rng = random.Random(15)
    with SidecarProcess(config) as sidecar:
        client = client_of(sidecar, config, page_size_tokens=PAGE)
        try:
            client.register_pools(client.create_pools(16))
            conversations = prompts(rng)
            for _ in range(25):
                whole = rng.choice(conversations)
                store(client, whole[: rng.randrange(0, 13) * PAGE], rng, 16)
                asked = [
                    rng.choice(conversations)[: rng.randrange(0, 13) * PAGE + rng.randrange(PAGE)]
                    for _ in range(6)
                ]
                by_tokens = [client.lookup(tokens) for tokens in asked]
                keys = [client.page_keys(tokens) for tokens in asked]
                assert [client.lookup_keys(k) for k in keys] == by_tokens
                assert client.lookup_many(keys) == by_tokens
                assert client.lookup_many(asked) == by_tokens  # token lists keyed by the client
            assert any(hit.tokens_total for hit in by_tokens)  # some hits among the misses
            # a growing prompt keys only its new pages: the same keys as keying it whole
            tokens = conversations[0]
            head = client.page_keys(tokens[: 5 * PAGE + 3])
            assert client.page_keys(tokens, extend=head).blobs == client.page_keys(tokens).blobs
        finally:
            client.close()


def test_lookup_many_on_the_async_client(served: SidecarProcess, lfm2_file_l3: Path) -> None:
    async def main() -> None:
        loaded = load_deployment(lfm2_file_l3)
        client = await connect_async(served.socket, loaded.layer_map(), page_size_tokens=PAGE)
        try:
            await client.register_pools(client.create_pools(8))
            tokens = list(range(6 * PAGE))
            await client.store(tokens[: 4 * PAGE], {"full": [0, 1, 2, 3]}, {"conv": {64: 4}})
            asked = [tokens, tokens[: 4 * PAGE + 5], tokens[:PAGE], list(range(900, 964))]
            keys = [client.page_keys(t) for t in asked]
            hits = await client.lookup_many(keys)
            assert [h.tokens_l2 for h in hits] == [64, 64, 0, 0]  # conv: a snapshot at 4 only
            assert hits == [await client.lookup(t) for t in asked]
            assert await client.lookup_keys(keys[1]) == hits[1]
            assert await client.lookup_many([]) == []
        finally:
            await client.close()

    asyncio.run(main())


def refused(client: Client, op: str, args: dict[str, Any]) -> str:
    with pytest.raises(ClientError) as caught:
        client.call(op, args)
    assert caught.value.code == p.ErrorCode.BAD_REQUEST, caught.value
    return caught.value.message


def test_bad_key_blobs_are_refused_by_name(served: SidecarProcess, lfm2_file_l3: Path) -> None:
    client = client_of(served, lfm2_file_l3, page_size_tokens=PAGE)
    try:
        client.register_pools(client.create_pools(8))
        keys = client.page_keys(list(range(3 * PAGE)))
        full, conv = keys.blobs["full"], keys.blobs["conv"]
        assert refused(client, "lookup_keys", {"keys": {"full": full + b"x", "conv": conv}}) == (
            "lookup_keys.keys.full: the engine sent 49 bytes, not a whole number of 16-byte page "
            "keys; send the group's keys concatenated"
        )
        assert refused(client, "lookup_keys", {"keys": {"full": full}}) == (
            "lookup_keys.keys: groups ['conv'] missing; give the keys of exactly ['conv', 'full'] "
            "(hello's keys.roots names them)"
        )
        assert refused(
            client, "lookup_keys", {"keys": {"full": full, "conv": conv, "swa": full}}
        ) == (
            "lookup_keys.keys: groups ['swa'] are not cached here; give the keys of exactly "
            "['conv', 'full'] (hello's keys.roots names them)"
        )
        assert refused(client, "lookup_keys", {"keys": {"full": full, "conv": conv[:16]}}) == (
            "lookup_keys.keys: the engine sent {'full': 3, 'conv': 1} keys per group; a prompt "
            "has one key per full page in every group"
        )
        assert refused(
            client, "lookup_keys", {"keys": {"full": full, "conv": conv}, "num_tokens": 64}
        ) == (
            "lookup_keys.num_tokens: 64 tokens are 4 full pages of 16 tokens; the engine sent 3 "
            "keys per group"
        )
        many = bytes(KEY_BYTES) * (p.MAX_TOKENS // PAGE + 1)
        assert refused(client, "lookup_keys", {"keys": {"full": many, "conv": many}}) == (
            "lookup_keys.keys.full: the engine sent 65537 keys, 1048592 tokens at 16 tokens per "
            "page; a lookup covers at most 1048576 tokens (65536 keys)"
        )
        message = refused(client, "lookup_keys", {"keys": {"full": [1, 2], "conv": conv}})
        assert message.startswith("lookup_keys.keys.full: Input should be a valid bytes"), message
        message = refused(
            client,
            "lookup_many",
            {"lookups": [keys.args(), {"keys": {"full": full[:-1], "conv": conv}}]},
        )
        assert message.startswith("lookup_many.lookups.1.keys.full: the engine sent 47 bytes")
        # the connection carries on
        assert client.lookup_keys(keys) == client.lookup(list(range(3 * PAGE)))
        # keys computed under roots the sidecar no longer gives are refused by the client
        stale = KeySpec(PAGE, "xxh3_128", {g: bytes(KEY_BYTES) for g in keys.blobs})
        with pytest.raises(ClientError, match=r"computed under key roots the sidecar no longer"):
            client.lookup_keys(stale.keys(list(range(3 * PAGE))))
    finally:
        client.close()


def test_keys_of_another_namespace_never_hit(served: SidecarProcess, lfm2_file_l3: Path) -> None:
    tokens = list(range(4 * PAGE))
    clients = {
        tenant: client_of(served, lfm2_file_l3, page_size_tokens=PAGE, tenant=tenant)
        for tenant in ("acme", "globex")
    }
    try:
        for client in clients.values():
            client.register_pools(client.create_pools(8))
        acme, globex = clients["acme"], clients["globex"]
        acme.store(tokens, {"full": [0, 1, 2, 3]}, {"conv": {64: 4}})
        assert acme.lookup_keys(acme.page_keys(tokens)).tokens_l2 == 64
        # the same tokens keyed with globex's roots: its own namespace's keys, not acme's
        assert globex.session["keys"]["roots"] != acme.session["keys"]["roots"]
        assert globex.lookup_keys(globex.page_keys(tokens)).tokens_total == 0
        # a keyer with a root of no namespace: its keys are nobody's (L3 asked, no false hit)
        forged = KeySpec(PAGE, "xxh3_128", {g: b"\x01" * KEY_BYTES for g in ("full", "conv")})
        forged_args = forged.keys(tokens).args()
        for client in clients.values():
            reply = client.call("lookup_keys", forged_args)
            assert (reply["tokens_l2"], reply["tokens_total"]) == (0, 0)
    finally:
        for client in clients.values():
            client.close()


def test_hello_gives_the_namespaces_own_roots(served: SidecarProcess, lfm2_file_l3: Path) -> None:
    """Before the namespace exists (computed as `Namespace.start` will) and after (its
    cache's keyers), the roots are the same; the keys they give hit what the tokens hit."""
    tokens = list(range(4 * PAGE))
    engine = client_of(served, lfm2_file_l3, page_size_tokens=PAGE, tenant="t", engine="e")
    try:
        before = engine.session["keys"]
        assert before["algorithm"] == "xxh3_128"
        assert before["page_size_tokens"] == PAGE
        assert sorted(before["roots"]) == ["conv", "full"]
        engine.register_pools(engine.create_pools(8))
        engine.store(tokens, {"full": [0, 1, 2, 3]}, {"conv": {64: 4}})
        scheduler = client_of(
            served, lfm2_file_l3, page_size_tokens=PAGE, tenant="t", engine="e", role="lookup"
        )
        try:
            assert scheduler.session["keys"] == before
            assert scheduler.lookup_keys(scheduler.page_keys(tokens)).tokens_l2 == 64
        finally:
            scheduler.close()
    finally:
        engine.close()


def test_discovery_by_keys_after_a_restart(lfm2_file_l3: Path) -> None:
    """A new sidecar's index is empty; L3 (the file store) still holds the pages: a lookup
    by keys asks it, as the token lookup does."""
    tokens = list(range(5 * PAGE))
    with SidecarProcess(lfm2_file_l3) as first:
        client = client_of(first, lfm2_file_l3, page_size_tokens=PAGE)
        client.register_pools(client.create_pools(8))
        client.store(tokens[: 4 * PAGE], {"full": [0, 1, 2, 3]}, {"conv": {64: 4}})
        keys = client.page_keys(tokens)
        client.close()  # the drain flushes what the write policy owes to L3
    with SidecarProcess(lfm2_file_l3) as second:
        client = client_of(second, lfm2_file_l3, page_size_tokens=PAGE)
        try:
            client.register_pools(client.create_pools(8))
            assert client.session["keys"]["roots"] == keys.spec.roots  # deterministic roots
            hit = client.lookup_keys(keys)
            assert (hit.tokens_l2, hit.tokens_total) == (0, 64)
            assert client.lookup_many([keys, keys]) == [hit, hit]
            assert client.lookup(tokens) == hit
        finally:
            client.close()
