"""Two tensor-parallel ranks against one real `hicache serve`: each rank's namespace keeps
its own heads (rank 1 never loads rank 0's bytes, after L2 is dropped: from L3), an MLA
latent is stored in L3 once and rank 1 loads the object rank 0 wrote, and a hello whose
tp_size or tp_rank does not fit the deployment is refused with both values named."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from hicache.client import Client, ClientError, connect
from hicache.client.process import SidecarProcess
from hicache.config import load_deployment
from tests.service.conftest import wait_persisted

PAGE = 16
PAGES = 4
TOKENS = list(range(5000, 5000 + PAGES * PAGE))

LLAMA = {  # GQA: 4 KV heads, 2 per rank at tp_size 2
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
}
DEEPSEEK = {  # MLA: one 48-wide latent per token, the same on every rank
    "model_type": "deepseek_v3",
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 8,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
}


def deployment(tmp_path: Path, model: dict[str, Any], tp_size: int = 2) -> Path:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(model))
    data = {
        "model": {"config_path": str(config), "page_size_tokens": PAGE, "tp_size": tp_size},
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": "8MiB"},
        "storage": {"kind": "file", "path": str(tmp_path / "l3")},
        "cache": {"prefetch_policy": "wait_complete"},
        "service": {
            "socket_path": str(tmp_path / "e.sock"),
            "http_port": 0,
            "heartbeat_timeout_s": 5,
            "admin_without_token": True,
        },
    }
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def post(proc: SidecarProcess, path: str) -> Any:
    request = urllib.request.Request(proc.http + path, method="POST", data=b"")
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def rank_client(proc: SidecarProcess, config: Path, tp_rank: int) -> Client:
    layer_map = load_deployment(config).layer_map()
    return connect(proc.socket, layer_map, page_size_tokens=PAGE, tp_rank=tp_rank, heartbeat=False)


def fill(client: Client, seed: int) -> dict[str, list[torch.Tensor]]:
    """Random bytes in pages 0..PAGES-1 of every group (distinct per seed); returns a copy."""
    assert client.pools is not None
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {}
    for name, pool in client.pools.device_pools().items():
        for layer in pool.tensors:
            for tensor in layer.values():
                rows = tensor[: PAGES * PAGE]
                rows.copy_(torch.randn(rows.shape, generator=generator).to(rows.dtype))
                out.setdefault(name, []).append(rows.clone())
    return out


def loaded_back(client: Client) -> dict[str, list[torch.Tensor]]:
    """Load the prompt into pages PAGES..2*PAGES-1 (zeroed first) and return those rows."""
    assert client.pools is not None
    pools = client.pools.device_pools()
    target = {name: list(range(PAGES, 2 * PAGES)) for name in pools}
    for pool in pools.values():
        for layer in pool.tensors:
            for tensor in layer.values():
                tensor[PAGES * PAGE : 2 * PAGES * PAGE].zero_()
    handle = client.load(TOKENS, target)
    assert handle is not None
    for layer_id in client.layer_map.stage_layer_ids:
        handle.wait_layer(layer_id)
    assert handle.done() == "done"
    return {
        name: [
            t[PAGES * PAGE : 2 * PAGES * PAGE].clone()
            for layer in pool.tensors
            for t in layer.values()
        ]
        for name, pool in pools.items()
    }


def same(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(x, y) for name in a for x, y in zip(a[name], b[name], strict=True)
    )


def l3_objects(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "l3").rglob("*") if p.is_file() and not p.name.startswith(".")]


def namespace(proc: SidecarProcess, tp_rank: int) -> dict[str, Any]:
    for ns in proc.get_json("/v1/stats")["namespaces"]:
        if ns["namespace"] == f"tp_rank={tp_rank} tenant=''":
            return dict(ns)
    raise AssertionError(f"no namespace for tp_rank {tp_rank}")


def test_two_ranks_keep_their_own_heads(tmp_path: Path) -> None:
    config = deployment(tmp_path, LLAMA)
    with SidecarProcess(config) as proc:
        ranks = [rank_client(proc, config, r) for r in (0, 1)]
        try:
            assert [c.session["tp_size"] for c in ranks] == [2, 2]
            assert ranks[0].session["replicated_groups"] == []
            assert ranks[0].geometries["full"].group.spec.num_kv_heads == 2  # 4 heads / 2
            stored = []
            for rank, client in enumerate(ranks):
                client.register_pools(client.create_pools(2 * PAGES))
                stored.append(fill(client, seed=rank))
                reply = client.store(TOKENS, {"full": list(range(PAGES))})
                assert reply["pages_stored"] == PAGES
            assert not same(stored[0], stored[1])
            # each rank's pages are its own objects: 2 x 4 in L3. Waited for by the persist
            # counter: an object is visible before its write releases the L2 page (#32)
            wait_persisted(proc, 2 * PAGES)
            assert len(l3_objects(tmp_path)) == 2 * PAGES
            cleared = post(proc, "/v1/admin/clear?tier=l2")
            assert cleared == {"tier": "l2", "pages_dropped": 2 * PAGES, "pages_held": 0}
            for client in ranks:
                assert client.lookup(TOKENS).tokens_l2 == 0
            back = [loaded_back(client) for client in ranks]
            assert same(back[0], stored[0])  # from L3, exactly rank 0's bytes
            assert same(back[1], stored[1])  # and rank 1's: never rank 0's
            assert not same(back[1], stored[0])
        finally:
            for client in ranks:
                client.close()


def test_an_mla_latent_is_stored_once_and_served_to_every_rank(tmp_path: Path) -> None:
    config = deployment(tmp_path, DEEPSEEK)
    with SidecarProcess(config) as proc:
        ranks = [rank_client(proc, config, r) for r in (0, 1)]
        try:
            assert ranks[1].session["replicated_groups"] == ["full"]
            for client in ranks:
                client.register_pools(client.create_pools(2 * PAGES))
            written = fill(ranks[0], seed=7)
            assert ranks[0].store(TOKENS, {"full": list(range(PAGES))})["pages_stored"] == PAGES
            wait_persisted(proc, PAGES)
            assert len(l3_objects(tmp_path)) == PAGES
            # rank 1 computed the same latent: it stores it in its own L2, never in L3
            fill(ranks[1], seed=7)
            assert ranks[1].store(TOKENS, {"full": list(range(PAGES))})["pages_stored"] == PAGES
            assert namespace(proc, 1)["persist"]["offered_pages"] == 0
            assert len(l3_objects(tmp_path)) == PAGES  # one object per page, not one per rank
            assert post(proc, "/v1/admin/clear?tier=l2")["pages_held"] == 0
            assert ranks[1].lookup(TOKENS).tokens_total == PAGES * PAGE  # rank 0's objects
            assert same(loaded_back(ranks[1]), written)
            assert len(l3_objects(tmp_path)) == PAGES
        finally:
            for client in ranks:
                client.close()


def test_a_hello_that_does_not_fit_the_deployments_tp_size_is_refused(tmp_path: Path) -> None:
    config = deployment(tmp_path, LLAMA)
    layer_map = load_deployment(config).layer_map()
    with SidecarProcess(config) as proc:
        with pytest.raises(ClientError) as wrong_size:
            connect(proc.socket, layer_map, page_size_tokens=PAGE, tp_size=4, heartbeat=False)
        assert (
            "hello.tp_size: the engine runs tensor-parallel size 4; this sidecar serves "
            "model.tp_size = 2" in str(wrong_size.value)
        )
        with pytest.raises(ClientError) as no_such_rank:
            connect(proc.socket, layer_map, page_size_tokens=PAGE, tp_rank=2, heartbeat=False)
        assert "hello.tp_rank: 2 is not a rank of tp_size 2 (model.tp_size = 2); allowed: 0..1" in (
            str(no_such_rank.value)
        )
