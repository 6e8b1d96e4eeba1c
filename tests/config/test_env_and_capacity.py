"""Environment overrides read by each field's type (never as YAML), the L3 guard settings
reaching the `GuardedStore`, and the warning for a tier too small for one long prompt."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from hicache.assembly import host_pages, open_store, store_of
from hicache.config import load_deployment
from hicache.config.capacity import LONG_PROMPT_TOKENS, TOO_SMALL, capacity_warnings
from hicache.errors import ConfigError
from tests.conftest import REPO


def write(tmp_path: Path, text: str = "", **model: object) -> Path:
    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        **model,
    }
    (tmp_path / "model.json").write_text(json.dumps(config))
    path = tmp_path / "deploy.yaml"
    path.write_text("model:\n  config_path: model.json\n" + text)
    return path


@pytest.mark.parametrize("token", ["null", "123", "yes", "~", "[1]", "0x10"])
def test_a_token_from_the_environment_is_that_string(tmp_path: Path, token: str) -> None:
    loaded = load_deployment(write(tmp_path), env={"HICACHE_SERVICE__TOKEN": token})
    secret = loaded.deployment.service.token
    assert secret is not None
    assert secret.get_secret_value() == token
    assert loaded.sources["service.token"] == "environment"
    assert loaded.env_vars["service.token"] == "HICACHE_SERVICE__TOKEN"


@pytest.mark.parametrize(
    ("var", "raw", "key", "value"),
    [
        ("HICACHE_SCHEDULER__QUEUE_DEPTH", "8", "scheduler.queue_depth", 8),
        ("HICACHE_SCHEDULER__QUEUE_DEPTH", " 1_000 ", "scheduler.queue_depth", 1000),
        ("HICACHE_SCHEDULER__OP_TIMEOUT_S", "2.5", "scheduler.op_timeout_s", 2.5),
        ("HICACHE_SCHEDULER__OP_TIMEOUT_S", "3", "scheduler.op_timeout_s", 3.0),
        ("HICACHE_HOST__PREFAULT", "FALSE", "host.prefault", False),
        ("HICACHE_HOST__PREFAULT", "1", "host.prefault", True),
        ("HICACHE_HOST__CAPACITY_BYTES", "1GiB", "host.capacity_bytes", 1 << 30),
        ("HICACHE_HOST__CAPACITY_BYTES", "4194304", "host.capacity_bytes", 1 << 22),
        ("HICACHE_SERVICE__HTTP_PORT", "", "service.http_port", None),
        ("HICACHE_SERVICE__HTTP_PORT", "null", "service.http_port", None),
        ("HICACHE_SERVICE__HTTP_PORT", "0", "service.http_port", 0),
        ("HICACHE_MODEL__STATE_DTYPE", "", "model.state_dtype", None),
        ("HICACHE_MODEL__STATE_DTYPE", "float32", "model.state_dtype", "float32"),
        ("HICACHE_CACHE__PREFETCH_TIMEOUT_S", "auto", "cache.prefetch_timeout_s", "auto"),
        ("HICACHE_CACHE__PREFETCH_TIMEOUT_S", "0.5", "cache.prefetch_timeout_s", 0.5),
        ("HICACHE_CACHE__TENANT_SALT", "007", "cache.tenant_salt", "007"),
        ("HICACHE_MODEL__NAME", "true", "model.name", "true"),
        ("HICACHE_STORAGE__BREAKER_FAILURE_THRESHOLD", "9", "storage.breaker_failure_threshold", 9),
    ],
)
def test_values_are_read_by_the_fields_type(
    tmp_path: Path, var: str, raw: str, key: str, value: object
) -> None:
    loaded = load_deployment(write(tmp_path, "service:\n  http_port: 9401\n"), env={var: raw})
    section, name = key.split(".")
    assert getattr(getattr(loaded.deployment, section), name) == value
    assert (loaded.sources[key], loaded.env_vars[key]) == ("environment", var)


@pytest.mark.parametrize(
    ("var", "raw", "message"),
    [
        (
            "HICACHE_SCHEDULER__QUEUE_DEPTH",
            "8.0",
            "environment variable HICACHE_SCHEDULER__QUEUE_DEPTH: '8.0' is not allowed for "
            "scheduler.queue_depth; allowed: an integer such as 8",
        ),
        (
            "HICACHE_SCHEDULER__QUEUE_DEPTH",
            "",
            "environment variable HICACHE_SCHEDULER__QUEUE_DEPTH: '' is not allowed for "
            "scheduler.queue_depth; allowed: an integer such as 8",
        ),
        (
            "HICACHE_HOST__PREFAULT",
            "yes",
            "environment variable HICACHE_HOST__PREFAULT: 'yes' is not allowed for "
            "host.prefault; allowed: a boolean: true, false, 1 or 0",
        ),
        (
            "HICACHE_SCHEDULER__OP_TIMEOUT_S",
            "soon",
            "environment variable HICACHE_SCHEDULER__OP_TIMEOUT_S: 'soon' is not allowed for "
            "scheduler.op_timeout_s; allowed: a number such as 2.5 or 1e-3",
        ),
        (
            "HICACHE_SERVICE__TCP_PORT",
            "off",
            "environment variable HICACHE_SERVICE__TCP_PORT: 'off' is not allowed for "
            "service.tcp_port; allowed: an integer such as 8, or empty or null to unset it",
        ),
        (
            "HICACHE_CACHE__PREFETCH_TIMEOUT_S",
            "never",
            "environment variable HICACHE_CACHE__PREFETCH_TIMEOUT_S: 'never' is not allowed for "
            "cache.prefetch_timeout_s; allowed: one of auto, or a number such as 2.5 or 1e-3",
        ),
        (
            "HICACHE_MODEL__LAYERS",
            "[oops",
            "environment variable HICACHE_MODEL__LAYERS: '[oops' is not allowed for "
            "model.layers; allowed: JSON (Expecting value at character 1)",
        ),
        (
            "HICACHE_HOST",
            "1GiB",
            "environment variable HICACHE_HOST: host is a section, not a key; set its keys one "
            "variable each (HICACHE_HOST__KEY), allowed keys in host: capacity_bytes, layout, ",
        ),
    ],
)
def test_a_value_its_field_cannot_take_is_refused_naming_the_variable(
    tmp_path: Path, var: str, raw: str, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_deployment(write(tmp_path), env={var: raw})
    assert str(caught.value).startswith(message)


def test_a_blank_token_from_the_environment_is_still_refused_not_unset(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"service\.token: a blank token is no secret"):
        load_deployment(write(tmp_path), env={"HICACHE_SERVICE__TOKEN": ""})


def test_storage_keys_follow_the_kind_the_environment_picks(tmp_path: Path) -> None:
    env = {"HICACHE_STORAGE__KIND": "redis", "HICACHE_STORAGE__MAX_CONNECTIONS": "4"}
    storage = load_deployment(write(tmp_path), env=env).deployment.storage
    assert (storage.kind, storage.max_connections) == ("redis", 4)  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"'many' is not allowed for storage\.max_connections"):
        load_deployment(write(tmp_path), env={**env, "HICACHE_STORAGE__MAX_CONNECTIONS": "many"})


def test_the_deployments_l3_guard_settings_reach_the_guarded_store(tmp_path: Path) -> None:
    text = (
        "storage:\n  kind: file\n  path: l3\n  base_timeout_s: 0.2\n"
        "  min_bandwidth_bytes_per_s: 2.0e+6\n  chunk_bytes: 4MiB\n"
    )
    env = {
        "HICACHE_STORAGE__BREAKER_FAILURE_THRESHOLD": "5",
        "HICACHE_STORAGE__BREAKER_RESET_AFTER_S": "12.5",
    }
    loaded = load_deployment(write(tmp_path, text), env=env)
    for store in (open_store(loaded), store_of(loaded.deployment.storage)):
        assert store is not None
        assert (store.base_timeout_s, store.min_bandwidth, store.chunk_bytes) == (0.2, 2e6, 4 << 20)
        assert (store.breaker.failure_threshold, store.breaker.reset_after_s) == (5, 12.5)
    defaults = open_store(load_deployment(write(tmp_path, "storage:\n  path: l3\n"), env={}))
    assert defaults is not None
    assert (defaults.base_timeout_s, defaults.min_bandwidth, defaults.chunk_bytes) == (
        1.0,
        50e6,
        16 << 20,
    )
    assert (defaults.breaker.failure_threshold, defaults.breaker.reset_after_s) == (3, 5.0)
    assert (
        store_of(load_deployment(write(tmp_path, "storage:\n  kind: none\n")).deployment.storage)
        is None
    )


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("base_timeout_s", "0", "Input should be greater than 0"),
        ("base_timeout_s", ".inf", "Input should be a finite number"),
        ("breaker_failure_threshold", "0", "Input should be greater than or equal to 1"),
        ("breaker_reset_after_s", "7200", "Input should be less than or equal to 3600"),
        ("chunk_bytes", "1KiB", "Input should be greater than or equal to 65536"),
        ("min_bandwidth_bytes_per_s", "10", "Input should be greater than or equal to 10000"),
    ],
)
def test_l3_guard_settings_out_of_bounds_are_refused(
    tmp_path: Path, key: str, value: str, problem: str
) -> None:
    path = write(tmp_path, f"storage:\n  kind: file\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: storage\.{key}: {problem}"):
        load_deployment(path, env={})
    with pytest.raises(ConfigError, match=r"storage\.base_timeout_s: unknown key"):
        load_deployment(write(tmp_path, "storage:\n  kind: none\n  base_timeout_s: 1\n"), env={})


def _warnings(
    tmp_path: Path,
    text: str,
    caplog: pytest.LogCaptureFixture,
    env: dict[str, str] | None = None,
    **model: object,
) -> list[str]:
    loaded = load_deployment(write(tmp_path, text, **model), env=env or {})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hicache.config"):
        host_pages(loaded, loaded.layer_map())
    return [r.getMessage() for r in caplog.records if r.name == "hicache.config"]


def test_a_tier_too_small_for_one_long_prompt_is_one_warning_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # llama, 2 layers, 2 kv heads x 64 dims, bf16, K+V: 1 KiB a token, 16 KiB a page
    text = "host:\n  capacity_bytes: 1MiB\nstorage:\n  capacity_bytes: 256\n"
    lines = _warnings(tmp_path, text, caplog, max_position_embeddings=4096)
    path = tmp_path / "deploy.yaml"
    assert lines == [
        f"L2 {TOO_SMALL}: {path}: host.capacity_bytes 1MiB holds 64 pages, one long prompt needs "
        "256 (4096 tokens, the model's max_position_embeddings); set host.capacity_bytes to at "
        "least 4MiB to cache one",
        f"L3 (file) {TOO_SMALL}: {path}: storage.capacity_bytes 256B holds 0 pages, one long "
        "prompt needs 256 (4096 tokens, the model's max_position_embeddings); set "
        "storage.capacity_bytes to at least 4MiB to cache one",
    ]
    # a long context is capped at 32k tokens; unknown, 32k; the variable that set it named
    env = {"HICACHE_HOST__CAPACITY_BYTES": "8MiB"}
    (line,) = _warnings(tmp_path, "", caplog, env, max_position_embeddings=1 << 20)
    assert line.startswith(
        f"L2 {TOO_SMALL}: HICACHE_HOST__CAPACITY_BYTES (environment variable): "
        "host.capacity_bytes 8MiB holds 512 pages, one long prompt needs 2048 (32768 tokens of "
        "max_position_embeddings 1048576); set host.capacity_bytes to at least 32MiB"
    )
    (line,) = _warnings(tmp_path, "", caplog, env)
    assert "(32768 tokens, max_position_embeddings unknown)" in line
    assert LONG_PROMPT_TOKENS == 32768
    roomy = "host:\n  capacity_bytes: 64MiB\nstorage:\n  capacity_bytes: 64MiB\n"
    assert _warnings(tmp_path, roomy, caplog) == []


def test_capacity_warnings_count_the_token_share_of_l2(tmp_path: Path) -> None:
    loaded = load_deployment(write(tmp_path, "host:\n  state_fraction: 0.5\n"), env={})
    # 2048 pages of 16 tokens needed; 1 KiB token pages, half of L2 for them: 4 MiB
    (line,) = capacity_warnings(loaded, {"full": 1024}, {"linear": 4096}, {"full": 10})
    assert "set host.capacity_bytes to at least 4MiB" in line
    assert capacity_warnings(loaded, {}, {"linear": 4096}, {"linear": 1}) == []


def test_review_refusals_name_the_variable(tmp_path: Path) -> None:
    """An empty path would resolve to the config file's own directory, a token with a
    trailing newline (a secret file's) would fail every engine, an infinite timeout would
    never fire: each is refused naming where it came from."""
    config = tmp_path / "d.yaml"
    config.write_text(
        (REPO / "configs" / "default.yaml").read_text().replace("../", str(REPO) + "/")
    )
    with pytest.raises(ConfigError, match=r"HICACHE_STORAGE__PATH: storage.path is empty"):
        load_deployment(config, env={"HICACHE_STORAGE__PATH": ""})
    with pytest.raises(ConfigError, match=r"leading or trailing whitespace"):
        load_deployment(config, env={"HICACHE_SERVICE__TOKEN": "s3cret\n"})
    with pytest.raises(ConfigError, match=r"HICACHE_SERVICE__DRAIN_TIMEOUT_S"):
        load_deployment(config, env={"HICACHE_SERVICE__DRAIN_TIMEOUT_S": "inf"})
