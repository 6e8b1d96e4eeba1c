"""A real `hicache serve` on a real Redis Cluster L3 (issue #17): 3 masters with a replica
each, one cluster and one sidecar per module, engines speaking only `hicache.client`.

First an engine stores prompts with known bytes; the sidecar writes them through to the
cluster, L2 is cleared (`POST /v1/admin/clear?tier=l2`, open via `admin_without_token`) and a
fresh engine loads every page byte-exact from L3 (the stats count the L3 hits), the objects
spread over every master (DBSIZE per master). Then an engine cycles through more prompts than
the 4 MiB L2 holds (so its hits come from L3), loading, checking every byte and storing, while
one master is SIGKILLed: it sees exact hits or misses and never an error, `/readyz` stays 200
(`ready, degraded` while the breaker is open), and once the replica is promoted its loads hit
again. The kill runs last (it leaves one master without a replica).

Also runnable as that engine: `python -m tests.service.test_redis_cluster_sidecar engine
--config FILE --prompts N --until STOPFILE --out EVENTS`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, shared_model

if __name__ != "__main__":  # the test (an engine process needs none of this)
    from tests.storage.servers import REDIS_CLIENT

    pytest.importorskip("redis", reason=REDIS_CLIENT)
    import redis

    from hicache.client.process import SidecarProcess
    from hicache.testing.local_servers import RedisClusterServers as ClusterType
    from tests.service.conftest import engine, engine_result, wait_persisted
    from tests.storage.servers import RedisClusterServers

PAGE = 16
FIRST_PROMPTS = 4  # the byte-exact test: 18 full-attention pages and 4 conv states
OBJECTS_FIRST = 2 + 4 * FIRST_PROMPTS + FIRST_PROMPTS  # (2 shared pages per prompt)
LOOP_PROMPTS = 8  # 34 full-attention pages cycled against a 4 MiB L2 (~20 such pages)
SETTLE_S = 20.0  # liveness bounds, not timing asserts
FAILOVER_S = 20.0


def engine_main(argv: list[str]) -> int:
    """Cycle through `--prompts` prompts until `--until` exists: load (every byte checked),
    then store; one JSON line per request appended to `--out`."""
    from hicache.client import connect_deployment
    from hicache.config import load_deployment
    from tests.service.engine_proc import (
        PROMPT_PAGES,
        load_and_verify,
        pages_for,
        prefill,
        prompt,
        store,
        wipe,
    )

    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--prompts", type=int, required=True)
    parser.add_argument("--until", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    loaded = load_deployment(args.config)
    client = connect_deployment(loaded, engine="redis-cluster-loop")
    pools = client.create_pools(64)
    client.register_pools(pools)
    until = Path(args.until)
    i = 0
    try:
        with Path(args.out).open("a", buffering=1) as out:
            while not until.exists():
                tokens = prompt(i % args.prompts)
                event: dict[str, Any] = {"t": time.time(), "tokens": len(tokens)}
                try:
                    wipe(pools)
                    verified, mismatches, loaded_tokens = load_and_verify(
                        client, pools, tokens, pages_for(client, pools, 32, PROMPT_PAGES)
                    )
                    event.update(loaded=loaded_tokens, verified=verified, mismatches=mismatches)
                    src = pages_for(client, pools, 0, PROMPT_PAGES)
                    prefill(client, pools, tokens, src)
                    store(client, tokens, src)
                except (Exception, SystemExit) as exc:
                    event["error"] = f"{type(exc).__name__}: {exc}"
                out.write(json.dumps(event) + "\n")
                i += 1
    finally:
        client.close()
    return 0


def write_config(tmp_path: Path, url: str) -> Path:
    data = {
        "model": {"config_path": str(shared_model("lfm2_350m.json")), "page_size_tokens": PAGE},
        "device": {"kind": "cpu"},
        "host": {"capacity_bytes": "4MiB"},
        "storage": {
            "kind": "redis",
            "url": url,
            "socket_timeout_s": 0.5,
            "base_timeout_s": 1.0,
            "breaker_reset_after_s": 0.5,
        },
        "cache": {"prefetch_policy": "wait_complete"},  # a load waits for L3: hits are hits
        "service": {
            "socket_path": str(tmp_path / "e.sock"),
            "http_port": 0,
            "heartbeat_timeout_s": 10,
            "admin_without_token": True,
        },
    }
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterType]:
    servers = RedisClusterServers(tmp_path_factory.mktemp("cluster"))
    servers.start()
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory, cluster: ClusterType) -> Path:
    return write_config(tmp_path_factory.mktemp("sidecar"), cluster.seed_url)


@pytest.fixture(scope="module")
def sidecar(config: Path) -> Iterator[SidecarProcess]:
    proc = SidecarProcess(config).start()
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


def _l3(sidecar: SidecarProcess) -> dict[str, Any]:
    l3: dict[str, Any] = sidecar.get_json("/v1/stats")["l3"]
    return l3


def _clear_l2(sidecar: SidecarProcess) -> dict[str, Any]:
    request = urllib.request.Request(
        sidecar.http + "/v1/admin/clear?tier=l2", data=b"", method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200
        cleared: dict[str, Any] = json.loads(reply.read())
    return cleared


def _keys_per_master(cluster: ClusterType) -> dict[int, int]:
    return {
        port: int(redis.Redis(host=cluster.host, port=port).dbsize())
        for port in cluster.master_ports()
    }


def test_pages_flushed_to_the_cluster_load_byte_exact_after_l2_is_cleared(
    cluster: ClusterType, sidecar: SidecarProcess, config: Path
) -> None:
    stored = engine_result(engine("roundtrip", config, "--prompts", str(FIRST_PROMPTS)))
    assert stored["mismatches"] == 0
    # write-through, behind the acknowledgement: wait until those writes have ended (an
    # object is stored before its write lets go of the L2 page, which a clear would keep)
    wait_persisted(sidecar, OBJECTS_FIRST)
    before = _l3(sidecar)
    assert before["failures"] == {}, before
    assert before["stored"] >= OBJECTS_FIRST, before
    cleared = _clear_l2(sidecar)
    assert (cleared["tier"], cleared["pages_held"]) == ("l2", 0), cleared
    loaded = engine_result(engine("verify", config, "--prompts", str(FIRST_PROMPTS)))
    assert loaded == {
        "verified": OBJECTS_FIRST + 2 * (FIRST_PROMPTS - 1),  # the shared pages, per prompt
        "mismatches": 0,
        "prompts_hit": FIRST_PROMPTS,
    }
    after = _l3(sidecar)
    assert after["hits"] - before["hits"] >= OBJECTS_FIRST, (before, after)
    assert after["misses"] == before["misses"], (before, after)
    per_master = _keys_per_master(cluster)
    assert len(per_master) == cluster.masters
    assert all(n > 0 for n in per_master.values()), f"a master holds no object: {per_master}"
    assert sum(per_master.values()) >= OBJECTS_FIRST, per_master


def _start_loop(config: Path, until: Path, out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.service.test_redis_cluster_sidecar",
            "engine",
            "--config",
            str(config),
            "--prompts",
            str(LOOP_PROMPTS),
            "--until",
            str(until),
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def _events(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def _wait_for_l3_hits(
    sidecar: SidecarProcess, out: Path, since: float, what: str
) -> list[dict[str, Any]]:
    """Until the loop has loaded from L3 after `since` (L3 hits grew, a load after it hit)."""
    hits_then = _l3(sidecar)["hits"]
    deadline = time.monotonic() + SETTLE_S
    while True:
        hit = [e for e in _events(out) if e["t"] > since and e.get("loaded", 0) > 0]
        l3 = _l3(sidecar)
        if hit and l3["hits"] > hits_then:
            return hit
        assert time.monotonic() < deadline, f"no L3 hit {what}: {l3}, events {_events(out)[-5:]}"
        time.sleep(0.1)


def test_a_master_killed_under_a_loading_engine_gives_misses_then_hits_again(
    cluster: ClusterType, sidecar: SidecarProcess, config: Path, tmp_path: Path
) -> None:
    until = tmp_path / "stop"
    out = tmp_path / "loop.jsonl"
    loop = _start_loop(config, until, out)
    readiness: list[tuple[int, str]] = []
    breakers: set[str] = set()
    try:
        _wait_for_l3_hits(sidecar, out, 0.0, "before the kill")
        killed_port = cluster.kill_master(0)
        killed = time.time()
        deadline = time.monotonic() + FAILOVER_S
        while True:  # poll readiness while the replica takes over
            status, body = sidecar.get("/readyz")
            ready = json.loads(body)
            readiness.append((status, ready["status"]))
            breakers.add(str(ready["l3_breaker"]))
            try:
                cluster.wait_ok(0.2, replicas=cluster.masters - 1)
                break
            except RuntimeError:
                assert time.monotonic() < deadline, f"no failover of {killed_port}"
        promoted = time.time()
        hits_after = _wait_for_l3_hits(sidecar, out, promoted + 1.0, "after the failover")
    finally:
        until.touch()
        _, err = loop.communicate(timeout=60)
    assert loop.returncode == 0, f"the engine failed ({loop.returncode}):\n{err[-3000:]}"
    events = _events(out)
    during = [e for e in events if killed <= e["t"] < promoted]
    print(
        f"failover of {killed_port}: {promoted - killed:.1f} s, {len(during)} requests during "
        f"it ({sum(e.get('loaded', 0) == 0 for e in during)} misses), breaker states seen "
        f"{sorted(breakers)}, readiness {sorted(set(readiness))}, L3 {_l3(sidecar)}"
    )
    errors = [e for e in events if "error" in e]
    assert not errors, f"{len(errors)} engine errors, the first: {errors[0]}"
    assert sum(e["mismatches"] for e in events) == 0, "a loaded page held wrong bytes"
    assert all(e["verified"] > 0 for e in hits_after)
    assert {status for status, _ in readiness} == {200}, readiness
    assert {text for _, text in readiness} <= {"ready", "ready, degraded"}, readiness
    assert sum(_l3(sidecar)["failures"].values()) > 0, "the kill failed no L3 call"
    assert _keys_per_master(cluster), "the promoted cluster answers no DBSIZE"


if __name__ == "__main__":
    if sys.argv[1:2] == ["engine"]:
        sys.exit(engine_main(sys.argv[2:]))
    sys.exit(f"usage: python -m {__spec__.name if __spec__ else __file__} engine ...")
