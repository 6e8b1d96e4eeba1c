"""A damaged page in the middle of an L3 prefix: a load serves the intact pages before it,
byte-exact, and leaves nothing pinned or reserved (#32, item 5).

The hit a load asks L3 for is the whole prompt; when page k does not verify (its object
corrupt, or not an object at all) the index learns from L3's answer that k is gone, and the
load's fetch looks the prompt up again: the longest prefix the tiers still serve may need
pages the longer hit did not — a sliding window's pages before k (gpt-oss: the window's
pages at the end of the prompt were all the long hit needed), a state group's snapshot at the
shorter length (LFM2: one stored every two pages) — which a second round fetches. Before,
such a load served 0 tokens. Real file and Redis backends under the tiered cache, and a real
`hicache serve` with an engine on the client API.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
import yaml

from hicache.cache import TieredCache
from hicache.client import connect
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from hicache.index import KEY_BYTES
from hicache.storage import GuardedStore
from hicache.testing.local_servers import RedisServer as RedisServerType
from tests.conftest import shared_model
from tests.service.conftest import wait_persisted
from tests.storage.servers import REDIS_CLIENT, RedisServer
from tests.test_tiered import PAGE, build, snapshot, split_args

SLIDING_PROMPT_PAGES = 40  # gpt-oss-20b: a 128-token window is 32 pages of 4 tokens
Damage = Callable[[bytes], Any]  # damages the object of one page key


def _file_damage(root: Path) -> Damage:
    def damage(key: bytes) -> None:  # one byte of the payload flipped: fails its checksum
        name = key.hex()
        path = root / name[:2] / f"{name}.kv"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))

    return damage


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServerType]:
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest_asyncio.fixture(params=["file", "redis"])
async def l3(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Damage]:
    """The tiered cache's L3 for the test (`tmp_path / "l3"` for files), and how to damage
    one page's object in it."""
    if request.param == "file":
        yield _file_damage(tmp_path / "l3")
        return
    pytest.importorskip("redis", reason=REDIS_CLIENT)
    import redis.asyncio as aioredis

    server: RedisServerType = request.getfixturevalue("redis_server")
    raw = aioredis.Redis.from_url(server.url)

    async def damage(key: bytes) -> None:  # a list where the object was: not an object
        name = f"hicache:{{{key.hex()}}}"
        await raw.delete(name)
        await raw.rpush(name, b"not an object")

    request.node.redis_url = server.url
    yield damage
    await raw.aclose()


def _cache(tmp_path: Path, request: pytest.FixtureRequest, model: str, pages: int) -> TieredCache:
    cache, _ = build(
        tmp_path,
        model,
        host_pages=4 * pages,
        device_token_pages=2 * pages,
        prefetch_policy="wait_complete",
    )
    url = getattr(request.node, "redis_url", None)
    if url is not None:  # the same cache over a real Redis instead of the files
        from hicache.storage.redis_backend import RedisBackend

        cache.attach_l3(GuardedStore(RedisBackend(url, socket_timeout_s=30.0), base_timeout_s=30.0))
    return cache


def _nothing_held(cache: TieredCache) -> None:
    cache.planner.check()
    for group in cache.index.rules:
        assert cache.index.pinned_pages(group) == 0, group
        assert cache.planner.pending[group] == set(), group
        assert cache.host_pool_stats(group).pinned_pages == 0, group


async def _store_clear_damage(
    cache: TieredCache, tokens: list[int], args: dict[str, Any], damage: Damage, group: str, k: int
) -> None:
    await cache.store(tokens, **args)
    await cache.persist.idle()
    assert cache.persist.stats().written_pages > 0
    cache.clear_l2()
    key = cache.index.keys(tokens)[group][k]
    done = damage(key)
    if asyncio.iscoroutine(done):
        await done


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("damaged", "k", "served"),
    [
        ("full", 5, 5),  # the window before page 5 was never needed by the 40-page hit
        ("sliding", 36, 36),  # a window page: 36 pages need the window 4..35 only
    ],
)
async def test_a_damaged_page_serves_the_intact_prefix_before_it(
    tmp_path: Path,
    request: pytest.FixtureRequest,
    l3: Damage,
    damaged: str,
    k: int,
    served: int,
) -> None:
    n = SLIDING_PROMPT_PAGES
    cache = _cache(tmp_path, request, "gpt_oss_20b.json", n)
    tokens = list(range(11, 11 + PAGE * n))
    stored_pages = {g: list(range(n)) for g in cache.index.rules}
    before = snapshot(cache, stored_pages)
    async with cache.running():
        await _store_clear_damage(
            cache, tokens, split_args(cache, tokens, stored_pages), l3, damaged, k
        )
        assert cache.lookup(tokens).pages_total == n  # the index still believes L3
        target = {g: list(range(n, 2 * n)) for g in cache.index.rules}
        handle, hit = await cache.load(tokens, target)
        assert handle is not None
        assert (await handle.done()).ok
        assert hit.pages_total == served
        assert hit.failed == {damaged: (k,)}
        after = snapshot(cache, target)
        for group, rows in hit.needed.items():  # every page the load moved, byte-exact
            assert rows, group
            for i, _ in rows:
                for (g, layer, t, j), rows_before in before.items():
                    if g == group and j == i:
                        assert torch.equal(after[(g, layer, t, i)], rows_before), (g, layer, i)
        assert cache.lookup(tokens).pages_total == served  # k stays a miss
        _nothing_held(cache)


@pytest.mark.asyncio
async def test_a_hybrid_load_shortens_to_a_snapshot_that_matches_its_length(
    tmp_path: Path, request: pytest.FixtureRequest, l3: Damage
) -> None:
    """LFM2 (conv state + full attention), snapshots after 2, 4, 6 and 8 pages: full page 5
    damaged, the load serves 4 pages and the snapshot stored after 4, never a longer one."""
    n = 8
    cache = _cache(tmp_path, request, "lfm2_350m.json", n)
    tokens = list(range(23, 23 + PAGE * n))
    (state,) = [g for g, r in cache.index.rules.items() if not r.kind.is_token_cache]
    args = split_args(cache, tokens, {"full": list(range(n)), state: [0]})
    args["snapshots"][state] = {2 * PAGE: 0, 4 * PAGE: 1, 6 * PAGE: 2, 8 * PAGE: 3}
    snapshots_before = snapshot(cache, {state: [0, 1, 2, 3]})
    full_before = snapshot(cache, {"full": list(range(n))})
    async with cache.running():
        await _store_clear_damage(cache, tokens, args, l3, "full", 5)
        handle, hit = await cache.load(tokens, {"full": list(range(n, 2 * n)), state: [3]})
        assert handle is not None
        assert (await handle.done()).ok
        assert hit.pages_total == 4
        assert [i for i, _ in hit.needed[state]] == [3]  # the snapshot after 4 pages
        loaded_state = snapshot(cache, {state: [3]})
        for (g, layer, t, _), rows in loaded_state.items():
            assert torch.equal(rows, snapshots_before[(g, layer, t, 1)]), (g, layer)
        loaded_full = snapshot(cache, {"full": list(range(n, n + 4))})
        for (g, layer, t, i), rows in loaded_full.items():
            assert torch.equal(rows, full_before[(g, layer, t, i)]), (g, layer, i)
        _nothing_held(cache)


# ---- through a real `hicache serve` -------------------------------------------------------


def _deployment(tmp_path: Path) -> Path:
    data = {
        "model": {"config_path": str(shared_model("gpt_oss_20b.json")), "page_size_tokens": PAGE},
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": "64MiB"},
        "storage": {"kind": "file", "path": str(tmp_path / "l3")},
        "cache": {"prefetch_policy": "wait_complete"},
        "service": {
            "socket_path": str(tmp_path / "e.sock"),
            "http_port": 0,
            "admin_without_token": True,
        },
    }
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_sidecar_load_serves_the_intact_prefix_before_a_damaged_page(tmp_path: Path) -> None:
    import urllib.request

    n, k = SLIDING_PROMPT_PAGES, 5
    config = _deployment(tmp_path)
    tokens = list(range(31, 31 + PAGE * n))
    with SidecarProcess(config) as proc:
        layer_map = load_deployment(config).layer_map()
        client = connect(proc.socket, layer_map, page_size_tokens=PAGE, heartbeat=False)
        try:
            pools = client.create_pools(2 * n)
            client.register_pools(pools)
            generator = torch.Generator().manual_seed(5)
            stored: dict[tuple[str, int, str], torch.Tensor] = {}
            for name, pool in pools.device_pools().items():
                for layer, tensors in enumerate(pool.tensors):
                    for kind, tensor in tensors.items():
                        rows = tensor[: n * PAGE]
                        rows.copy_(torch.randn(rows.shape, generator=generator).to(rows.dtype))
                        stored[(name, layer, kind)] = rows.clone()
            groups = list(pools.device_pools())
            reply = client.store(tokens, {g: list(range(n)) for g in groups})
            assert reply["pages_stored"] == n * len(groups)  # every page of both groups
            wait_persisted(proc, n * len(groups))
            request = urllib.request.Request(
                proc.http + "/v1/admin/clear?tier=l2", method="POST", data=b""
            )
            with urllib.request.urlopen(request, timeout=30) as reply:
                assert json.loads(reply.read())["pages_held"] == 0
            blob = client.page_keys(tokens).blobs["full"]
            _file_damage(tmp_path / "l3")(blob[k * KEY_BYTES : (k + 1) * KEY_BYTES])
            for pool in pools.device_pools().values():
                for tensors in pool.tensors:
                    for tensor in tensors.values():
                        tensor[n * PAGE :].zero_()
            handle = client.load(tokens, {g: list(range(n, 2 * n)) for g in groups})
            assert handle is not None
            assert handle.tokens == k * PAGE
            for layer_id in client.layer_map.stage_layer_ids:
                handle.wait_layer(layer_id)
            assert handle.done() == "done"
            for (name, layer, kind), rows in stored.items():
                tensor = pools.device_pools()[name].tensors[layer][kind]
                loaded = tensor[n * PAGE : n * PAGE + k * PAGE]
                assert torch.equal(loaded, rows[: k * PAGE]), (name, layer, kind)
            stats = proc.get_json("/v1/stats")["namespaces"][0]["groups"]
            assert all(
                g["pinned_pages"] == 0 and g["host_pinned_pages"] == 0 for g in stats.values()
            )
        finally:
            client.close()
