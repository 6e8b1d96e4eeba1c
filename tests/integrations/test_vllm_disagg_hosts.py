"""Prefill/decode through the cache across two hosts, with real vLLM (the CPU build): the
prefill instance (`kv_producer`, `persisted_within_s`) on host A's sidecar, the decode
instance (`kv_consumer`) on host B's, the two sidecars sharing one L3 in A's namespace — a
Mooncake Store (its master), and a Redis Cluster (the test hosts are network namespaces
joined by a veth, `hicache.testing.netns_hosts`, as tests/storage/test_two_hosts.py builds
them, L3 servers too). The engines run outside both namespaces and reach their sidecar by its
Unix socket; each sidecar's L3 client lives in its host, so B's reads of A's pages cross the
veth.

docs/engines.md's proxy (`disaggregated`) sends each prompt to the prefill instance with
`max_tokens=1` — answered once L3 holds its pages — then to the decode instance. Judges: the
decode instance's tokens and per-step logprobs equal its own run of the same prompts with
nothing to load (first, on an empty L3), its `num_cached_tokens` covers every complete page
(loaded from L3 through B's sidecar, which never saw the prompts: its discovery asked L3),
the prefill counted every store persisted, and the bytes crossed B's link.

Needs root (namespaces), the Mooncake wheel or redis-server, and vLLM; skips where they are
missing, fails under CI for the first three (CI has them) as the two-host tests do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from hicache.client.process import SidecarProcess
from hicache.testing import local_servers, netns_hosts
from hicache.testing.netns_hosts import Host, TwoHosts
from tests.integrations.test_vllm_disagg import (
    DECODE_TOKENS,
    KIND,
    P,
    disaggregated,
    full_pages,
    prompt,
)
from tests.integrations.vllm_harness import EngineProcess, write_deployment
from tests.integrations.vllm_models import build_model

if not os.environ.get("_HICACHE_REQUIRE_VLLM"):
    pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (python3 dev.py setup)")

PROMPTS = [prompt(21), prompt(22)]


def _missing(kind: str) -> str | None:
    why_not = netns_hosts.available()
    if why_not is not None:
        return f"two test hosts need network namespaces: {why_not}"
    if kind == "redis_cluster":
        gone = [b for b in ("redis-server", "redis-cli") if local_servers.find_binary(b) is None]
        return f"{' and '.join(gone)} not installed" if gone else None
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the platform's wheel
        return f"mooncake-transfer-engine cannot be imported: {exc}"
    return None


@pytest.fixture(scope="module", params=["mooncake", "redis_cluster"])
def l3_kind(request: pytest.FixtureRequest) -> str:
    kind = str(request.param)
    missing = _missing(kind)
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(missing, pytrace=False)
        pytest.skip(missing)
    return kind


@dataclass
class Hosts:
    hosts: TwoHosts
    sidecars: dict[Host, SidecarProcess]
    prefill: EngineProcess
    decode: EngineProcess
    work: Path
    reference: dict[tuple[int, ...], dict[str, Any]]

    def stats(self, host: Host) -> dict[str, Any]:
        sidecar = self.sidecars[host]
        stats: dict[str, Any] = self.hosts.within(host, lambda: sidecar.get_json("/v1/stats"))
        return stats


def deployment(work: Path, model: Path, storage: dict[str, Any]) -> Path:
    """The harness's llama deployment with the shared L3 instead of its file L3."""
    path = write_deployment(work, model, KIND)
    data = yaml.safe_load(path.read_text())
    # 5 s: a busy machine's healthy get over the veth can take > 1 s
    data["storage"] = {**storage, "base_timeout_s": 5.0}
    path.write_text(yaml.safe_dump(data))
    return path


def _start_l3(kind: str, hosts: TwoHosts, work: Path) -> tuple[Any, str]:
    """The shared L3's servers in A's namespace, bound to A's address; and the address
    the sidecars' storage sections name."""
    prefix = hosts.command_prefix("a")
    if kind == "mooncake":
        master = local_servers.MooncakeMaster(host=hosts.address["a"], command_prefix=prefix)
        master.start()
        return master, master.address
    servers = local_servers.RedisClusterServers(
        work / "redis", host=hosts.address["a"], command_prefix=prefix
    )
    hosts.within("a", servers.start)  # its readiness probes from A's namespace
    return servers, servers.seed_url


def _storage(kind: str, address: str, local: str) -> dict[str, Any]:
    if kind == "mooncake":
        return {
            "kind": "mooncake",
            "master_address": address,
            "local_hostname": local,
            "global_segment_bytes": "256MiB",
            "local_buffer_bytes": "64MiB",
        }
    return {"kind": "redis", "url": address}


@pytest.fixture(scope="module")
def pair(l3_kind: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    work = tmp_path_factory.mktemp(f"vllm_disagg_hosts_{l3_kind}")
    model = build_model(KIND, tmp_path_factory.mktemp("vllm_models"))
    hosts = TwoHosts()
    servers: Any = None
    sidecars: dict[Host, SidecarProcess] = {}
    engines: list[EngineProcess] = []
    try:
        servers, address = _start_l3(l3_kind, hosts, work)
        for h in ("a", "b"):
            storage = _storage(l3_kind, address, hosts.address[h])
            config = deployment(work / h, model, storage)
            sidecars[h] = hosts.within(h, SidecarProcess(config).start)
        for name, role, host, extra in (
            # answered once L3 holds the prompt's pages: B reads them from there
            ("prefill", "kv_producer", "a", {"persisted_within_s": 30}),
            ("decode", "kv_consumer", "b", {}),
        ):
            connector = {
                "config": str(work / host / "deploy.yaml"),
                "stats_path": str(work / f"{name}.stats.json"),
                **extra,
            }
            engines.append(EngineProcess(work, model, connector=connector, name=name, kv_role=role))
        prefill, decode = (engine.ready() for engine in engines)
        # the reference: the decode instance alone, nothing in L3 to load (it never stores)
        alone = [decode.round([p], max_tokens=DECODE_TOKENS)[0] for p in PROMPTS]
        assert [r["cached"] for r in alone] == [0] * len(PROMPTS)
        # B's sidecar remembers L3's "absent" answers of those lookups (`l3_absent_ttl_s`);
        # the decode instance's lookups wait for its prefill's pages (`store_wait_s`), so
        # they ask L3 again at once rather than trust them (`cache/discovery.py`): the
        # decodes follow straight away, and still load what the prefill persisted
        reference = {tuple(p): r for p, r in zip(PROMPTS, alone, strict=True)}
        yield Hosts(hosts, sidecars, prefill, decode, work, reference)
    finally:
        for engine in engines:
            engine.close()
        codes: dict[Host, int | None] = {}
        for h, sidecar in sidecars.items():
            try:
                codes[h] = sidecar.stop()
            except Exception as exc:  # the rest is still stopped
                codes[h] = None
                print(f"host {h}: its sidecar did not stop cleanly: {exc!r}")
        if servers is not None:
            servers.stop()
        hosts.close()
    for h, code in codes.items():
        assert code == 0, sidecars[h].log_path.read_text()[-3000:]


def test_decode_on_another_host_loads_the_prefills_pages_from_l3(pair: Hosts) -> None:
    crossed_before = pair.hosts.received_bytes("b")
    results = disaggregated(pair.prefill, pair.decode, PROMPTS, DECODE_TOKENS)
    for tokens, got in zip(PROMPTS, results, strict=True):
        want = pair.reference[tuple(tokens)]
        assert (got["output"], got["logprobs"]) == (want["output"], want["logprobs"])
        assert got["cached"] == full_pages(tokens)  # from L3: B's sidecar never saw them
    prefill = json.loads((pair.work / "prefill.stats.json").read_text())
    assert prefill["stores_persisted"] == prefill["stores"] >= len(PROMPTS), prefill
    assert prefill["stores_not_persisted"] == 0, prefill
    decode = json.loads((pair.work / "decode.stats.json").read_text())
    assert (decode["stores"], decode["loads"], decode["load_failures"]) == (0, 2, 0), decode
    b = pair.stats("b")
    assert sum(int(ns["load"]["ops"]) for ns in b["namespaces"]) == len(PROMPTS)
    # B's L2 holds what it fetched from L3, the prompts' pages and nothing of its decodes
    pages = sum(g["l2_pages"] for ns in b["namespaces"] for g in ns["groups"].values())
    assert pages == sum(full_pages(t) // P for t in PROMPTS)
    crossed = pair.hosts.received_bytes("b") - crossed_before
    page_bytes = sum(
        g["l2_bytes"] // g["l2_capacity_pages"]
        for ns in b["namespaces"]
        for g in ns["groups"].values()
    )
    assert crossed > pages * page_bytes, (crossed, pages, page_bytes)
