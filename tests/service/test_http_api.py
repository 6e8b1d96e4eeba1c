"""The HTTP control API of a real `hicache serve`: health, readiness, metrics, config (secrets
redacted), stats, and the admin endpoints behind the token."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from hicache.service.process import SidecarProcess
from tests.service.conftest import engine, engine_result, write_config

TOKEN = "s3cret-token"


def post(proc: SidecarProcess, path: str, token: str | None = None, body: bytes | None = None):  # type: ignore[no-untyped-def]
    request = urllib.request.Request(proc.http + path, data=body or b"", method="POST")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    if body:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_health_ready_metrics_config_stats(tmp_path: Path) -> None:
    config = write_config(tmp_path, token=TOKEN)
    with SidecarProcess(config) as proc:
        assert proc.get("/healthz") == (200, '{"status": "alive"}')
        status, body = proc.get("/readyz")
        assert status == 200
        ready = json.loads(body)
        assert ready["ready"] is True
        assert ready["l3"] == "file"
        assert ready["l3_breaker"] == "closed"
        result = engine_result(engine("roundtrip", config, "--prompts", "2"))
        assert result["mismatches"] == 0
        status, text = proc.get("/metrics")
        assert status == 200
        # hybrid-aware hit counters, transfer histograms, pool gauges, breaker state
        assert 'hicache_lookup_tokens_total{tier="l2"}' in text
        assert 'hicache_transfer_bytes_count{direction="load"} 2.0' in text
        assert 'hicache_host_pool_capacity_bytes{group="full"}' in text
        assert "hicache_l3_breaker_state 0.0" in text
        assert 'hicache_request_seconds_count{op="store"} 2.0' in text
        assert "hicache_layer_stall_seconds_count" in text
        config_json = proc.get_json("/v1/config")
        assert config_json["service"]["token"] == "***"
        assert TOKEN not in json.dumps(config_json)
        stats = proc.get_json("/v1/stats")
        assert stats["l3"]["stored"] > 0
        assert stats["namespaces"][0]["load"]["ops"] == 2
        # the per-group gauges agree with the index (the scrape came before the stats call,
        # and nothing moved in between); lfm2's full-attention page is 196,608 bytes
        full = stats["namespaces"][0]["groups"]["full"]
        samples = {
            name: float(value)
            for name, value in (line.rsplit(" ", 1) for line in text.splitlines())
            if not name.startswith("#")
        }
        assert full["l2_pages"] > 0
        assert samples['hicache_host_pool_used_bytes{group="full"}'] == full["l2_pages"] * 196608
        capacity = full["l2_capacity_pages"] * 196608
        assert samples['hicache_host_pool_capacity_bytes{group="full"}'] == capacity
        assert samples['hicache_host_pool_pinned_bytes{group="full"}'] == 0
        assert samples['hicache_index_l3_only_pages{group="full"}'] == full["l3_only_pages"]


def test_admin_endpoints_need_the_token(tmp_path: Path) -> None:
    config = write_config(tmp_path, token=TOKEN)
    with SidecarProcess(config) as proc:
        engine_result(engine("roundtrip", config, "--prompts", "1"))
        status, text = post(proc, "/v1/admin/clear?tier=l2")
        assert status == 401
        assert "Authorization: Bearer <service.token>" in text
        assert post(proc, "/v1/admin/clear?tier=l2", token="wrong")[0] == 401
        status, reply = post(proc, "/v1/admin/clear?tier=l2", token=TOKEN)
        assert status == 200
        assert reply == {"tier": "l2", "pages_dropped": 7}
        status, text = post(proc, "/v1/admin/clear?tier=l9", token=TOKEN)
        assert (status, text) == (400, "tier 'l9' is not known; allowed: l2, l3")
        # L3 still holds the prompt: a fresh engine finds it there and verifies every byte
        again = engine_result(engine("verify", config, "--prompts", "1"))
        assert again == {"verified": 7, "mismatches": 0, "prompts_hit": 1}
        assert post(proc, "/v1/admin/l3/detach", token=TOKEN) == (200, {"l3": "detached"})
        assert json.loads(proc.get("/readyz")[1])["l3"] == "none"
        status, text = post(proc, "/v1/admin/l3/attach", token=TOKEN, body=b'{"kind": "nope"}')
        assert status == 400
        assert "storage section: " in text
        assert post(proc, "/v1/admin/l3/attach", token=TOKEN) == (200, {"l3": "file"})
        status, reply = post(proc, "/v1/admin/clear?tier=l3", token=TOKEN)
        assert status == 200
        assert reply["pages_deleted"] == 7


def test_readyz_reports_an_open_breaker(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    text = config.read_text().replace(
        f"kind: file\n  path: {tmp_path / 'l3'}", "kind: redis\n  url: redis://127.0.0.1:1/0"
    )
    config.write_text(text)
    with SidecarProcess(config) as proc:
        result = engine_result(engine("roundtrip", config, "--prompts", "3"))
        assert result["mismatches"] == 0  # L3 failures are misses, never errors
        status, body = proc.get("/readyz")
        assert status == 503
        assert json.loads(body)["problems"] == [
            "L3 breaker open (backend failing; loads serve L2 only)"
        ]
        assert "hicache_l3_breaker_state 2.0" in proc.get("/metrics")[1]


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_exposed_listener_requires_a_token(tmp_path: Path, host: str) -> None:
    from hicache.config import load_deployment
    from hicache.errors import ConfigError

    config = write_config(tmp_path, http_host=host)
    with pytest.raises(
        ConfigError, match=rf"http_host={host} binds beyond loopback; set service.token"
    ):
        load_deployment(config)
