"""Deployment config: every file in configs/, environment overrides, sources, and messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.config import Deployment, format_bytes, load_deployment, parse_bytes
from hicache.errors import ConfigError
from tests.conftest import CONFIGS


def test_default_config_is_cpu_with_small_host_tier_and_file_l3() -> None:
    d = load_deployment(CONFIGS / "default.yaml", env={}).deployment
    assert d.device.kind == "cpu"
    assert 64 * 2**20 <= d.host.capacity_bytes <= 1024 * 2**20
    assert d.storage.kind == "file"


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "model.json").write_text(
        json.dumps(
            {
                "model_type": "gpt_oss",
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "sliding_window": 128,
            }
        )
    )
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return path


BASE = "model:\n  config_path: model.json\n"


def test_env_overrides_and_sources(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + "host:\n  capacity_bytes: 128MiB\n")
    loaded = load_deployment(
        path,
        env={
            "HICACHE_SCHEDULER__QUEUE_DEPTH": "8",
            "HICACHE_HOST__LAYOUT": "page_first",
            "PATH": "/bin",
        },
    )
    d = loaded.deployment
    assert d.scheduler.queue_depth == 8
    assert d.host.layout == "page_first"
    assert d.host.capacity_bytes == 128 * 2**20
    assert d.model.config_path == tmp_path / "model.json"  # relative to the YAML file
    sources = {key: source for key, _, source in loaded.effective()}
    assert sources["scheduler.queue_depth"] == "environment"
    assert sources["host.capacity_bytes"] == "file"
    assert sources["host.prefault"] == "default"
    values = {key: value for key, value, _ in loaded.effective()}
    assert values["host.capacity_bytes"] == "128MiB"


def test_storage_without_kind_is_the_default_file_kind(tmp_path: Path) -> None:
    # a file with no storage section still takes a storage override from the environment
    loaded = load_deployment(write(tmp_path, BASE), env={"HICACHE_STORAGE__PATH": "/tmp/l3"})
    assert loaded.deployment.storage.kind == "file"
    assert str(loaded.deployment.storage.path) == "/tmp/l3"
    d = load_deployment(write(tmp_path, BASE + "storage:\n  capacity_bytes: 2GiB\n"), env={})
    assert d.deployment.storage.kind == "file"


def test_state_dtypes(tmp_path: Path) -> None:
    text = BASE + "  dtype: float8_e5m2\n  state_dtype: bfloat16\n  ssm_state_dtype: float32\n"
    model = load_deployment(write(tmp_path, text), env={}).deployment.model
    assert (model.dtype, model.state_dtype, model.ssm_state_dtype) == (
        "float8_e5m2",
        "bfloat16",
        "float32",
    )
    with pytest.raises(ConfigError, match=r"model\.ssm_state_dtype: Input should be 'bfloat16'"):
        load_deployment(write(tmp_path, BASE + "  ssm_state_dtype: fp32\n"), env={})


def test_secret_token_is_redacted(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + "service:\n  token: hunter2\n")
    loaded = load_deployment(path, env={})
    assert loaded.deployment.service.token is not None
    assert loaded.deployment.service.token.get_secret_value() == "hunter2"
    assert "hunter2" not in json.dumps(loaded.effective())


@pytest.mark.parametrize(
    ("text", "env", "pattern"),
    [
        (
            BASE + "host:\n  capasity_bytes: 1GiB\n",
            {},
            r"{f}: host\.capasity_bytes: unknown key; allowed keys here: capacity_bytes, layout, "
            r"pin_chunk_bytes, pin_memory, prefault, state_fraction$",
        ),
        (
            BASE + "host:\n  capacity_bytes: 12 parsecs\n",
            {},
            r"{f}: host\.capacity_bytes: '12 parsecs' is not a size; allowed: a byte count such as "
            r"4096, or a number with B, KB, MB, GB, TB, KiB, MiB, GiB or TiB \(got '12 parsecs'\)$",
        ),
        (
            BASE + "host:\n  layout: sideways\n",
            {},
            r"{f}: host\.layout: Input should be 'layer_first' or 'page_first' \(got 'sideways'\)$",
        ),
        (
            BASE,
            {"HICACHE_SCHEDULER__QUEUE_DEPTH": "0"},
            r"{f}: scheduler\.queue_depth: Input should be greater than or equal to 1 "
            r"\(got 0, from environment variable HICACHE_SCHEDULER__QUEUE_DEPTH\)$",
        ),
        (
            BASE,
            {"HICACHE_SCHEDULER__COLOUR": "red"},
            r"HICACHE_SCHEDULER__COLOUR \(environment variable\): unknown key scheduler\.colour; "
            r"allowed keys in scheduler: counter_ring_size, inflight_bytes, move_policy, "
            r"op_timeout_s, queue_depth$",
        ),
        (
            BASE + "storage:\n  kind: tape\n",
            {},
            r"{f}: storage: Input tag 'tape' found using 'kind' does not match any of the expected "
            r"tags: 'file', 'redis', 'mooncake', 'none'",
        ),
        (
            BASE + "storage:\n  kind: file\n  capacity_bytes: lots\n",
            {},
            r"{f}: storage\.capacity_bytes: 'lots' is not a size; allowed: ",
        ),
        (
            BASE + "storage:\n  kind: redis\n  uri: redis://x\n",
            {},
            r"{f}: storage\.uri: unknown key; allowed keys here: base_timeout_s, "
            r"breaker_failure_threshold, breaker_reset_after_s, chunk_bytes, cluster, key_prefix, kind, "
            r"max_connections, min_bandwidth_bytes_per_s, socket_timeout_s, url$",
        ),
        ("device:\n  kind: cpu\n", {}, r"{f}: model: Field required"),
        (
            "model:\n  config_path: model.json\n  layers: []\n",
            {},
            r"{f}: model: give exactly one of config_path \(a config\.json\) or layers$",
        ),
        ("- a\n- b\n", {}, r"{f}: the top level is list; a mapping of sections$"),
        ("model: [unclosed\n", {}, r"{f}: not valid YAML: "),
    ],
)
def test_errors_name_file_key_value_and_allowed(
    tmp_path: Path, text: str, env: dict[str, str], pattern: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="^" + pattern.replace("{f}", str(path))):
        load_deployment(path, env=env)


def test_missing_file_and_bad_env_key(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"^cannot read config file '/nonexistent\.yaml': No such file"
    ):
        load_deployment(Path("/nonexistent.yaml"), env={})
    path = write(tmp_path, BASE)
    with pytest.raises(
        ConfigError, match=r"^environment variable HICACHE_HOST____X: empty key part"
    ):
        load_deployment(path, env={"HICACHE_HOST____X": "1"})


def test_layout_errors_surface_as_config_errors(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  config_path: missing.json\n")
    with pytest.raises(ConfigError, match=rf"^{path}: model: cannot read model config "):
        load_deployment(path, env={}).layer_map()
    path = write(tmp_path, BASE + "  start_layer: 3\n  end_layer: 9\n")
    with pytest.raises(
        ConfigError,
        match=rf"^{path}: model\.start_layer/end_layer: pipeline stage "
        r"3\.\.9 is not a layer range of gpt_oss",
    ):
        load_deployment(path, env={}).layer_map()


def test_explicit_layers_inside_deployment(tmp_path: Path) -> None:
    path = tmp_path / "d.yaml"
    path.write_text(
        "model:\n  model_type: tiny\n  layers:\n"
        "    - {repeat: 3, kind: full, kv_heads: 2, head_dim: 32}\n"
    )
    layout = load_deployment(path, env={}).layout()
    assert (layout.model_type, layout.num_layers) == ("tiny", 3)


def test_sizes_round_trip() -> None:
    assert parse_bytes("64GiB") == 64 * 2**30
    assert parse_bytes("1.5 KB") == 1500
    assert parse_bytes(4096) == 4096
    assert format_bytes(parse_bytes("256MiB")) == "256MiB"
    for bad in ("-1", "1.5B", True, "GiB", -3):
        with pytest.raises(ValueError, match=r"not a|negative"):
            parse_bytes(bad)


def test_schema_has_every_section() -> None:
    schema = Deployment.model_json_schema()
    assert set(schema["properties"]) == {
        "model",
        "device",
        "host",
        "storage",
        "scheduler",
        "cache",
        "service",
        "tenants",
    }


def test_unknown_key_from_the_environment_reads_as_the_variable_then_the_keys(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, BASE)
    with pytest.raises(ConfigError) as caught:
        load_deployment(path, env={"HICACHE_SERVICE__COLOUR": "red"})
    message = str(caught.value)
    assert message.startswith(
        "HICACHE_SERVICE__COLOUR (environment variable): unknown key service.colour; "
        "allowed keys in service: admin_without_token, drain_timeout_s, "
    )
    assert message.endswith(", tcp_port, token")  # the list ends the line, nothing glued on
    with pytest.raises(
        ConfigError,
        match=r"^HICACHE_COLOUR \(environment variable\): unknown "
        r"key colour; allowed keys at the top level: cache, device, host, model",
    ):
        load_deployment(path, env={"HICACHE_COLOUR": "red"})


BLANK_TOKEN = (
    r"service\.token: a blank token is no secret; allowed: a non-blank string engines and "
    r"admins present, or no token at all \(leave service\.token out\) on loopback-only "
    r"listeners \(got a blank value, "
)


@pytest.mark.parametrize("token", ['""', "'   '", '"\\t"'])
@pytest.mark.parametrize("exposed", [False, True])
def test_blank_token_in_the_file_is_refused(tmp_path: Path, token: str, exposed: bool) -> None:
    listener = "  tcp_host: 0.0.0.0\n  tcp_port: 0\n" if exposed else ""
    path = write(tmp_path, BASE + f"service:\n{listener}  token: {token}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: {BLANK_TOKEN}'[^']*'\)$"):
        load_deployment(path, env={})


def test_blank_token_from_the_environment_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + "service:\n  tcp_host: 0.0.0.0\n  tcp_port: 0\n")
    with pytest.raises(
        ConfigError,
        match=rf"^{path}: {BLANK_TOKEN}'', from environment variable HICACHE_SERVICE__TOKEN\)$",
    ):
        load_deployment(path, env={"HICACHE_SERVICE__TOKEN": ""})
    token = load_deployment(path, env={"HICACHE_SERVICE__TOKEN": "s3cret"}).deployment.service
    assert token.token is not None
    assert token.token.get_secret_value() == "s3cret"


def test_a_bad_token_never_shows_its_characters(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + "service:\n  token: [hunter2]\n")
    with pytest.raises(ConfigError, match=r"service\.token: Input should be") as caught:
        load_deployment(path, env={})
    assert "hunter2" not in str(caught.value)


def test_storage_path_that_cannot_be_a_directory_is_refused(tmp_path: Path) -> None:
    regular = tmp_path / "afile"
    regular.write_text("x")
    allowed = "; allowed: a directory, or a path where one can be created, on a real filesystem"
    cases = {
        str(regular / "l3"): f"'{regular}/l3' is under '{regular}', which is a regular file",
        str(regular / "a" / "b"): f"'{regular}/a/b' is under '{regular}', which is a regular file",
        str(regular): f"'{regular}' is a regular file",
        "/proc/hicache-l3": "'/proc/hicache-l3' is in /proc, a kernel pseudo-filesystem",
        "/sys/l3": "'/sys/l3' is in /sys, a kernel pseudo-filesystem",
    }
    for where, problem in cases.items():
        path = write(tmp_path, BASE + f"storage:\n  kind: file\n  path: {where}\n")
        with pytest.raises(ConfigError) as caught:
            load_deployment(path, env={})
        assert str(caught.value) == f"{path}: storage.path: {problem}{allowed} (got {where!r})"
    # a path to create, under directories (or relative to the file) is fine
    for where in (str(tmp_path / "new" / "l3"), "l3", "/dev/shm/hicache-l3"):
        path = write(tmp_path, BASE + f"storage:\n  kind: file\n  path: {where}\n")
        assert load_deployment(path, env={}).deployment.storage.kind == "file"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("localhost:6379", r"'localhost:6379' is not a Redis URL \(scheme 'localhost'\)"),
        ("http://x", r"'http://x' is not a Redis URL \(scheme 'http'\)"),
        ("127.0.0.1", r"'127\.0\.0\.1' is not a Redis URL \(no scheme\)"),
        ("redis://h:99999/0", r"'redis://h:99999/0': Port out of range 0-65535"),
        ("redis://h:6379/zero", r"'redis://h:6379/zero': database 'zero' is not a number"),
        ("unix://", r"'unix://' names no socket path"),
    ],
)
def test_redis_url_that_is_not_one_is_refused(tmp_path: Path, url: str, problem: str) -> None:
    path = write(tmp_path, BASE + f"storage:\n  kind: redis\n  url: '{url}'\n")
    with pytest.raises(
        ConfigError, match=rf"^{path}: storage\.url: {problem}; allowed: redis://\[user:"
    ):
        load_deployment(path, env={})


def test_a_refused_redis_url_never_shows_its_password(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + "storage:\n  kind: redis\n  url: 'http://admin:hunter2@x'\n")
    with pytest.raises(ConfigError) as info:
        load_deployment(path, env={})
    assert "hunter2" not in str(info.value)
    assert "'http://admin:***@x' is not a Redis URL (scheme 'http')" in str(info.value)


@pytest.mark.asyncio
async def test_redis_failures_never_show_the_password() -> None:
    """The breaker keeps the latest failure's text and /readyz (no token needed) lists it."""
    from hicache.storage import GuardedStore
    from hicache.storage.redis_backend import RedisBackend

    backend = RedisBackend("redis://admin:hunter2@127.0.0.1:9/0", socket_timeout_s=0.5)
    store = GuardedStore(backend)
    try:
        assert await store.exists([b"k"]) == [False]
        why = store.breaker.describe()["why"]
        assert why is not None
        assert "hunter2" not in why
        assert "redis://admin:***@127.0.0.1:9/0" in why
    finally:
        await backend.close()


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/0", "rediss://u:p@cache.example:6380", "redis://", "unix:///s"]
)
def test_redis_urls_redis_py_reads_are_accepted(tmp_path: Path, url: str) -> None:
    path = write(tmp_path, BASE + f"storage:\n  kind: redis\n  url: '{url}'\n")
    assert load_deployment(path, env={}).deployment.storage.kind == "redis"


def test_binary_config_file_is_named_as_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_bytes(b"model:\n  config_path: \xff\xfe.json\n")
    with pytest.raises(
        ConfigError,
        match=rf"^{path}: not UTF-8 text \(byte 0xff at offset 22\); allowed: a UTF-8 YAML "
        "deployment file$",
    ):
        load_deployment(path, env={})
    path.write_bytes(b"\xef\xbb\xbf" + BASE.encode())  # a byte-order mark is still UTF-8
    assert load_deployment(path, env={}).deployment.model.config_path == tmp_path / "model.json"
