"""The HTTP control API of a real `hicache serve`: health, readiness, metrics, config (secrets
redacted), stats, and the admin endpoints behind the token."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp.test_utils import TestClient, TestServer

from hicache.client.process import SidecarProcess
from hicache.service.http_api import ControlApi
from hicache.service.metrics import ServiceMetrics
from hicache.service.server import EngineServer
from hicache.storage import CircuitBreaker, FileBackend, GuardedStore
from tests.service.conftest import engine, engine_result, wait_persisted, write_config

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
        assert ready["status"] == "ready"
        assert ready["degraded"] == []
        assert ready["l3"] == "file"
        assert ready["l3_breaker"] == "closed"
        result = engine_result(engine("roundtrip", config, "--prompts", "2"))
        assert result["mismatches"] == 0
        wait_persisted(proc, 1)  # the writes behind the stores pin L2 pages while they run
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
        assert stats["row_kernel"].startswith(("native C (", "numpy ("))  # CPU: which and why
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
        wait_persisted(proc, 7)  # the writes behind the acked store have let go of L2
        status, text = post(proc, "/v1/admin/clear?tier=l2")
        assert status == 401
        assert "Authorization: Bearer <service.token>" in text
        assert post(proc, "/v1/admin/clear?tier=l2", token="wrong")[0] == 401
        status, reply = post(proc, "/v1/admin/clear?tier=l2", token=TOKEN)
        assert status == 200
        assert reply == {"tier": "l2", "pages_dropped": 7, "pages_held": 0}
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
        # the index forgot what the detached store held; the attached one is asked again
        assert post(proc, "/v1/admin/clear?tier=l2", token=TOKEN)[0] == 200
        again = engine_result(engine("verify", config, "--prompts", "1"))
        assert again == {"verified": 7, "mismatches": 0, "prompts_hit": 1}
        status, reply = post(proc, "/v1/admin/clear?tier=l3", token=TOKEN)
        assert status == 200
        assert reply["pages_deleted"] == 7


def test_readyz_is_ready_but_degraded_behind_an_open_breaker(tmp_path: Path) -> None:
    """L2 still serves while L3 is failing: 200 "ready, degraded", the breaker listed (a
    503 would take a serving sidecar out of rotation; it is kept for not listening)."""
    config = write_config(tmp_path)
    text = config.read_text().replace(
        f"kind: file\n  path: {tmp_path / 'l3'}", "kind: redis\n  url: redis://127.0.0.1:1/0"
    )
    config.write_text(text)
    with SidecarProcess(config) as proc:
        result = engine_result(engine("roundtrip", config, "--prompts", "3"))
        assert result["mismatches"] == 0  # L3 failures are misses, never errors
        status, body = proc.get("/readyz")
        assert status == 200
        ready = json.loads(body)
        assert ready["ready"] is True
        assert ready["status"] == "ready, degraded"
        assert ready["problems"] == []
        (l3,) = ready["degraded"]
        assert l3["tier"] == "l3"
        assert l3["kind"] == "redis"
        assert l3["breaker"]["state"] in ("open", "half_open")
        assert l3["breaker"]["why"].startswith(("put:", "get:", "exists:", "probe:"))
        assert ready["l3_breaker"] == l3["breaker"]["state"]
        # read a moment later: the breaker may have moved between open and half-open (its
        # probe), never back to closed while Redis is unreachable
        (gauge,) = [
            line for line in proc.get("/metrics")[1].splitlines()
            if line.startswith("hicache_l3_breaker_state ")
        ]  # fmt: skip
        assert gauge in ("hicache_l3_breaker_state 1.0", "hicache_l3_breaker_state 2.0")


class _ReadinessInputs:
    """What `/readyz` reads of an `EngineServer`: whether it listens, its store, its
    namespaces and plan (a real server's readiness runs in the tests above)."""

    def __init__(self, store: GuardedStore | None, listening: bool):
        self.store = store
        self.listening = listening
        self.draining = False
        self.namespaces: dict[str, object] = {}
        self.plan = SimpleNamespace(storage_kind="file")


async def _readyz(inputs: _ReadinessInputs) -> tuple[int, dict[str, Any]]:
    api = ControlApi(cast(EngineServer, inputs), ServiceMetrics())
    async with TestClient(TestServer(api.app)) as client:
        reply = await client.get("/readyz")
        return reply.status, await reply.json()


@pytest.mark.asyncio
async def test_readyz_lists_an_open_and_a_half_open_breaker_and_stays_200(
    tmp_path: Path,
) -> None:
    now = [0.0]
    breaker = CircuitBreaker(2, reset_after_s=5.0, clock=lambda: now[0])
    store = GuardedStore(FileBackend(tmp_path, capacity_bytes=1 << 20), breaker=breaker)
    inputs = _ReadinessInputs(store, listening=True)
    status, body = await _readyz(inputs)
    assert (status, body["status"], body["degraded"]) == (200, "ready", [])
    breaker.failure("get:timeout")
    breaker.failure("exists:TierUnavailableError: redis at ...: ConnectionError")
    status, body = await _readyz(inputs)
    assert status == 200
    assert body["ready"] is True
    assert body["status"] == "ready, degraded"
    (l3,) = body["degraded"]
    assert l3["breaker"] == {
        "state": "open",
        "why": "exists:TierUnavailableError: redis at ...: ConnectionError",
        "failures_in_a_row": 2,
        "trial_in_s": 5.0,
    }
    now[0] = 5.0  # half-open: a trial is due, L3 is still not serving
    status, body = await _readyz(inputs)
    assert status == 200
    assert body["status"] == "ready, degraded"
    assert body["degraded"][0]["breaker"]["state"] == "half_open"
    assert body["l3_breaker"] == "half_open"
    breaker.success()
    status, body = await _readyz(inputs)
    assert (status, body["status"], body["degraded"]) == (200, "ready", [])
    inputs.listening = False  # not started, or draining: the only 503s
    status, body = await _readyz(inputs)
    assert status == 503
    assert body["ready"] is False
    assert body["status"] == "not ready"
    assert body["problems"] == ["engine channel not listening"]
    inputs.draining = True
    status, body = await _readyz(inputs)
    assert (status, body["problems"]) == (503, ["draining (SIGTERM): refusing new engines"])


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_exposed_listener_requires_a_token(tmp_path: Path, host: str) -> None:
    from hicache.config import load_deployment
    from hicache.errors import ConfigError

    config = write_config(tmp_path, http_host=host)
    with pytest.raises(
        ConfigError, match=rf"http_host={host} binds beyond loopback; set service.token"
    ):
        load_deployment(config)


class _AdminInputs:
    """What the admin endpoints read of an `EngineServer`: its plan and service settings,
    namespaces (none: clears drop nothing) and the store it swaps."""

    def __init__(self, tmp_path: Path, env: dict[str, str], **service: Any):
        from hicache.assembly.sidecar import sidecar_plan
        from hicache.config import load_deployment

        loaded = load_deployment(write_config(tmp_path, **service), env=env)
        self.plan = sidecar_plan(loaded)
        self.service = self.plan.service
        self.namespaces: dict[str, object] = {}
        self.store: GuardedStore | None = None

    def set_store(self, store: GuardedStore | None) -> GuardedStore | None:
        old, self.store = self.store, store
        return old


async def _admin(
    inputs: _AdminInputs, path: str, headers: dict[str, str] | None = None, body: Any = None
) -> tuple[int, str]:
    api = ControlApi(cast(EngineServer, inputs), ServiceMetrics())
    async with TestClient(TestServer(api.app)) as client:
        reply = await client.post(path, headers=headers or {}, json=body)
        return reply.status, await reply.text()


def _admin_events(caplog: pytest.LogCaptureFixture) -> list[tuple[str, dict[str, Any]]]:
    return [
        (r.levelname, r.fields)  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "hicache.service.admin"
    ]


@pytest.mark.asyncio
async def test_admin_endpoints_are_off_without_a_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from hicache.service.http_api import ADMIN_OFF

    inputs = _AdminInputs(tmp_path, {})
    caplog.set_level("INFO", logger="hicache.service.admin")
    for path in ("/v1/admin/clear?tier=l2", "/v1/admin/l3/detach", "/v1/admin/l3/attach"):
        status, text = await _admin(inputs, path)
        assert (status, text) == (403, ADMIN_OFF)
    assert "service.admin_without_token: true" in ADMIN_OFF
    assert "set service.token" in ADMIN_OFF
    events = _admin_events(caplog)
    assert [(level, f["action"], f["outcome"]) for level, f in events] == [
        ("WARNING", "clear", "refused: admin endpoints off"),
        ("WARNING", "l3_detach", "refused: admin endpoints off"),
        ("WARNING", "l3_attach", "refused: admin endpoints off"),
    ]
    assert events[0][1]["remote"] == "127.0.0.1"
    assert events[0][1]["tier"] == "l2"


@pytest.mark.asyncio
async def test_admin_without_token_opens_them_and_logs_each_call(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    inputs = _AdminInputs(tmp_path, {"HICACHE_SERVICE__ADMIN_WITHOUT_TOKEN": "true"})
    caplog.set_level("INFO", logger="hicache.service.admin")
    assert await _admin(inputs, "/v1/admin/clear?tier=l2") == (
        200,
        '{"tier": "l2", "pages_dropped": 0, "pages_held": 0}',
    )
    status, text = await _admin(inputs, "/v1/admin/clear?tier=l9")
    assert (status, text) == (400, "tier 'l9' is not known; allowed: l2, l3")
    assert (await _admin(inputs, "/v1/admin/l3/attach"))[0] == 200
    assert (await _admin(inputs, "/v1/admin/l3/detach"))[0] == 200
    events = [(level, f) for level, f in _admin_events(caplog)]
    assert [(level, f["action"], f["outcome"]) for level, f in events] == [
        ("INFO", "clear", "0 L2 pages dropped, 0 held"),
        ("WARNING", "clear", "refused: unknown tier"),
        ("INFO", "l3_attach", "attached file"),
        ("INFO", "l3_detach", "detached"),
    ]
    assert all(f["remote"] == "127.0.0.1" for _, f in events)
    assert events[1][1]["tier"] == "l9"
    assert events[2][1]["section"] == "configured"


@pytest.mark.asyncio
async def test_a_token_is_required_even_with_admin_without_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    inputs = _AdminInputs(tmp_path, {}, token=TOKEN, admin_without_token=True)
    caplog.set_level("INFO", logger="hicache.service.admin")
    status, text = await _admin(inputs, "/v1/admin/l3/detach")
    assert (status, text) == (401, "admin endpoints need 'Authorization: Bearer <service.token>'")
    wrong = {"Authorization": "Bearer nope"}
    assert (await _admin(inputs, "/v1/admin/l3/detach", wrong))[0] == 401
    right = {"Authorization": f"Bearer {TOKEN}"}
    assert (await _admin(inputs, "/v1/admin/l3/detach", right))[0] == 200
    outcomes = [f["outcome"] for _, f in _admin_events(caplog)]
    assert outcomes == [
        "refused: no Authorization header",
        "refused: wrong token",
        "no L3 attached",
    ]
    assert TOKEN not in caplog.text


@pytest.mark.asyncio
async def test_attach_builds_the_store_with_the_sections_timeouts_and_breaker(
    tmp_path: Path,
) -> None:
    inputs = _AdminInputs(
        tmp_path,
        {"HICACHE_STORAGE__BASE_TIMEOUT_S": "0.25", "HICACHE_STORAGE__CHUNK_BYTES": "1MiB"},
        admin_without_token=True,
    )
    assert (await _admin(inputs, "/v1/admin/l3/attach"))[0] == 200
    store = inputs.store
    assert store is not None
    assert (store.base_timeout_s, store.chunk_bytes) == (0.25, 1 << 20)
    body = {
        "kind": "file",
        "path": str(tmp_path / "other"),
        "min_bandwidth_bytes_per_s": 1e6,
        "breaker_failure_threshold": 7,
        "breaker_reset_after_s": 0.5,
    }
    assert (await _admin(inputs, "/v1/admin/l3/attach", body=body))[0] == 200
    store = inputs.store
    assert store is not None
    assert (store.base_timeout_s, store.min_bandwidth, store.chunk_bytes) == (1.0, 1e6, 16 << 20)
    assert (store.breaker.failure_threshold, store.breaker.reset_after_s) == (7, 0.5)
    status, text = await _admin(
        inputs, "/v1/admin/l3/attach", body={"kind": "file", "breaker_failure_threshold": 0}
    )
    assert status == 400
    assert "breaker_failure_threshold: Input should be greater than or equal to 1" in text
