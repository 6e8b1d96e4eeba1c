"""The docker files, statically (no Docker here): what the build context leaves out, the image
built once and reused, the Mooncake master only where its config is used, a healthcheck that
reads its port from the config, and what an engine needs to attach (a bind-mounted socket
directory, the engine's uid, the sidecar seeing the engine's pid). The healthcheck script
itself runs against a real sidecar."""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from hicache.config import load_deployment
from tests.conftest import CONFIGS, REPO

DOCKER = REPO / "docker"
BASE = DOCKER / "compose.yaml"
MOONCAKE = DOCKER / "compose.mooncake.yaml"
ENV = {"SIDECAR_TOKEN": "t"}


class _ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags (`!override`, `!reset`), kept as marked values."""


class Override(dict[str, Any]):
    pass


def _override(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.SequenceNode):  # the short form: `depends_on: !override [a, b]`
        return Override({str(name): {} for name in loader.construct_sequence(node, deep=True)})
    assert isinstance(node, yaml.MappingNode)
    return Override({str(k): v for k, v in loader.construct_mapping(node, deep=True).items()})


_ComposeLoader.add_constructor("!override", _override)


def compose(path: Path) -> dict[str, Any]:
    data = yaml.load(path.read_text(), Loader=_ComposeLoader)  # a SafeLoader
    assert isinstance(data, dict)
    return data


def interpolate(value: str, env: dict[str, str] = ENV) -> str:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR:?error}` against `env`."""

    def one(match: re.Match[str]) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        if op == ":?":
            raise AssertionError(f"${{{name}}} is required: {arg}")
        return arg or ""

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\?)([^}]*))?\}", one, value)


def mounts(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The service's volumes by container path, each as the long syntax."""
    out = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *opts = volume.split(":")
            kind = "bind" if source.startswith((".", "/", "$")) else "volume"
            volume = {"type": kind, "source": source, "target": target, "read_only": "ro" in opts}
        out[volume["target"]] = volume
    return out


def merged() -> dict[str, Any]:
    """docker/compose.yaml with docker/compose.mooncake.yaml over it, by Compose's merge rules
    for what these files use: mappings merged, volumes by target, `!override` replaces."""
    base, over = compose(BASE), compose(MOONCAKE)
    services = {name: dict(s) for name, s in base["services"].items()}
    for name, service in over["services"].items():
        into = services.setdefault(name, {})
        for key, value in service.items():
            if key == "volumes":
                by_target = {**mounts(into), **mounts(service)}
                into["volumes"] = list(by_target.values())
            elif isinstance(value, Override) or not isinstance(value, dict):
                into[key] = dict(value) if isinstance(value, Override) else value
            else:
                into[key] = {**into.get(key, {}), **value}
    return {"services": services}


def active(services: dict[str, Any]) -> dict[str, Any]:
    """The services `docker compose up` starts with no profile enabled."""
    return {name: s for name, s in services.items() if not s.get("profiles")}


def deployment_of(service: dict[str, Any]) -> Any:
    source = mounts(service)["/etc/hicache/deploy.yaml"]["source"]
    env = {k: interpolate(str(v)) for k, v in service["environment"].items()}
    return load_deployment((DOCKER / source).resolve(), env=env).deployment


# --- the build context ---------------------------------------------------------------------


def dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str) -> bool:
    """Whether `path` (relative to the context) or a folder above it is excluded."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in dockerignore():
        pattern = pattern.removeprefix("/")
        for candidate in prefixes:
            if fnmatch.fnmatch(candidate, pattern) or (
                pattern.startswith("**/") and fnmatch.fnmatch(candidate.split("/")[-1], pattern[3:])
            ):
                return True
    return False


@pytest.mark.parametrize(
    "path",
    [
        ".venv",
        ".git",
        "hicache/__pycache__",
        "hicache/x.pyc",
        ".pytest_cache",
        ".mypy_cache",
        ".ruff_cache",
        "build",
        "dist",
        "hicache.egg-info",
        ".hicache",
        ".hicache/engine.sock",
        "tmp",
    ],
)
def test_dockerignore_excludes(path: str) -> None:
    assert ignored(path), f".dockerignore sends {path} to the daemon"


def test_dockerignore_keeps_what_the_dockerfiles_copy() -> None:
    for dockerfile in sorted(DOCKER.glob("Dockerfile*")):
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                for source in line.split()[1:-1]:
                    assert not ignored(source), f"{dockerfile.name} copies {source}, ignored"
                    for file in (REPO / source).rglob("*.py") if (REPO / source).is_dir() else []:
                        rel = file.relative_to(REPO).as_posix()
                        assert not ignored(rel), f"{rel} would be left out of the image"


# --- compose -------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["redis", "mooncake"])
def test_the_image_is_built_once_and_reused(variant: str) -> None:
    services = active(compose(BASE)["services"] if variant == "redis" else merged()["services"])
    builders = {name: s for name, s in services.items() if "build" in s}
    assert list(builders) == ["hicache"]
    image = builders["hicache"]["image"]
    assert image == "hicache:cpu"
    for name, service in services.items():
        assert "build" in service or "image" in service, name
        if service.get("image", "").startswith("hicache"):
            assert service["image"] == image, f"{name} names another hicache image"


def test_redis_deployment_does_not_wait_for_a_mooncake_master() -> None:
    services = active(compose(BASE)["services"])
    assert "mooncake-master" not in services
    hicache = services["hicache"]
    assert set(hicache["depends_on"]) == {"redis"}
    assert deployment_of(hicache).storage.kind == "redis"


def test_mooncake_override_waits_for_the_master_and_the_store_only() -> None:
    services = active(merged()["services"])
    hicache = services["hicache"]
    assert set(hicache["depends_on"]) == {"mooncake-master", "mooncake-store"}
    assert "redis" not in services  # left out: nothing uses it
    deployment = deployment_of(hicache)
    assert deployment.storage.kind == "mooncake"
    host, port = deployment.storage.master_address.split(":")
    assert host == "mooncake-master"
    master = services["mooncake-master"]
    assert master["command"] == ["--port", port]
    assert port in " ".join(master["healthcheck"]["test"])
    assert "build" not in master


def test_the_mooncake_stores_memory_is_held_outside_the_sidecar() -> None:
    """The sidecar mounts no segment; `mooncake-store` (Mooncake's mooncake_client) holds the
    store's memory, joins the sidecar's master, names itself by its service name (the
    address the sidecar's transfers reach it at) and is checked where it serves health."""
    services = active(merged()["services"])
    deployment = deployment_of(services["hicache"])
    assert deployment.storage.global_segment_bytes == 0
    store = services["mooncake-store"]
    assert store["entrypoint"] == ["mooncake_client"]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in store["command"])
    assert flags["master_server_address"] == deployment.storage.master_address
    assert flags["metadata_server"] == deployment.storage.metadata_server
    assert flags["protocol"] == deployment.storage.protocol
    assert flags["host"] == "mooncake-store"
    assert interpolate(flags["global_segment_size"]) == "1GB"
    assert interpolate(flags["global_segment_size"], {"MOONCAKE_STORE_SIZE": "8GB"}) == "8GB"
    assert flags["enable_http_server"] == "true"
    assert f"127.0.0.1:{flags['http_port']}/health" in " ".join(store["healthcheck"]["test"])
    assert store["depends_on"] == ["mooncake-master"]
    assert "build" not in store


@pytest.mark.parametrize("variant", ["redis", "mooncake"])
def test_the_socket_directory_is_a_bind_mounted_host_directory(variant: str) -> None:
    services = compose(BASE)["services"] if variant == "redis" else merged()["services"]
    hicache = services["hicache"]
    socket_path = deployment_of(hicache).service.socket_path
    volume = mounts(hicache)[str(Path(socket_path).parent)]
    assert volume["type"] == "bind"  # a host directory a host engine can reach, not a volume
    assert interpolate(volume["source"]) == "/run/hicache"
    assert interpolate(volume["source"], {"ENGINE_SOCKET_DIR": "/srv/s"}) == "/srv/s"
    assert volume.get("bind", {}).get("create_host_path") is False
    assert "volumes" not in compose(BASE)  # no named volume left


def test_the_sidecar_runs_as_the_engines_uid() -> None:
    hicache = compose(BASE)["services"]["hicache"]
    assert interpolate(hicache["user"]) == "10001:10001"
    assert interpolate(hicache["user"], {"ENGINE_UID": "1000", "ENGINE_GID": "100"}) == "1000:100"
    args = hicache["build"]["args"]
    assert interpolate(str(args["UID"]), {"ENGINE_UID": "1000"}) == "1000"
    assert interpolate(str(args["GID"]), {"ENGINE_GID": "100"}) == "100"
    for dockerfile in sorted(DOCKER.glob("Dockerfile*")):
        text = dockerfile.read_text()
        assert "ARG UID=10001" in text
        assert "ARG GID=10001" in text
        assert '--uid "$UID"' in text
        assert '--gid "$GID"' in text


def test_the_sidecar_sees_engine_pids() -> None:
    hicache = compose(BASE)["services"]["hicache"]
    assert hicache["pid"] == "host"  # host engines' pids, and every container's
    assert "apparmor=unconfined" in hicache["security_opt"]
    text = BASE.read_text()
    assert 'pid: "service:hicache"' in text  # the documented containerised-only alternative
    assert "/proc/<engine pid>/fd" in text
    # what pid: host and an unconfined AppArmor profile leave: no capability, no setuid gain
    assert hicache["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in hicache["security_opt"]


def test_no_shared_memory_sizing_is_left() -> None:
    # memfds, not /dev/shm: no service sizes it, no run example asks for it
    for services in (compose(BASE)["services"], merged()["services"]):
        assert not [name for name, s in services.items() if "shm_size" in s]
    for path in sorted(DOCKER.iterdir()):
        assert not re.search(r"--shm-size[= ]\d", path.read_text()), path.name


def test_the_published_port_is_the_configs() -> None:
    hicache = compose(BASE)["services"]["hicache"]
    port = deployment_of(hicache).service.http_port
    assert [p.split(":")[-1] for p in hicache["ports"]] == [str(port)]


@pytest.mark.parametrize("variant", ["redis", "mooncake"])
def test_a_stop_or_restart_leaves_the_sidecar_its_whole_drain(variant: str) -> None:
    """`stop` / `restart` send SIGTERM, then SIGKILL after the service's grace period
    (Compose's default: 10 s). The sidecar's drain takes up to `service.drain_timeout_s`
    (the flush of what L3 is owed included) and the process then exits: the grace must
    exceed the drain with room to spare, or a busy restart cuts the flush off."""
    services = compose(BASE)["services"] if variant == "redis" else merged()["services"]
    hicache = services["hicache"]
    grace = re.fullmatch(r"(\d+)s", str(hicache.get("stop_grace_period", "10s")))
    assert grace is not None, hicache.get("stop_grace_period")
    drain_s = deployment_of(hicache).service.drain_timeout_s
    assert int(grace.group(1)) >= 2 * drain_s, (hicache.get("stop_grace_period"), drain_s)


def test_the_documented_container_line_leaves_the_sidecar_its_whole_drain() -> None:
    """The README's `podman run -d` (the image's own config: the default drain) likewise:
    `podman stop` / `docker stop` wait 10 s by default."""
    from hicache.config.service_schema import ServiceSection
    from tests.test_containers import readme_block

    (line,) = [c for c in readme_block("containers") if c.startswith("podman run -d ")]
    timeout = re.search(r"--stop-timeout (\d+) ", line)
    assert timeout is not None, line
    assert int(timeout.group(1)) >= 2 * ServiceSection().drain_timeout_s


def test_healthchecks_name_no_port_of_hicache() -> None:
    hicache = compose(BASE)["services"]["hicache"]
    test = hicache["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "/app/docker/healthcheck.py"]
    assert test[3:] == ["/etc/hicache/deploy.yaml"]  # the file it mounts
    assert not re.search(r"\b9400\b", " ".join(test))
    for dockerfile in sorted(DOCKER.glob("Dockerfile*")):
        text = dockerfile.read_text()
        check = text[text.index("HEALTHCHECK") :].split("\n\n")[0]
        assert '"/app/docker/healthcheck.py"' in check
        assert not re.search(r"\b9400\b", check), dockerfile.name
        assert "COPY docker/healthcheck.py ./docker/" in text


# --- the healthcheck script ----------------------------------------------------------------


@pytest.fixture(scope="module")
def healthcheck() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hicache_healthcheck", DOCKER / "healthcheck.py")
    assert spec
    assert spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_health_url(healthcheck: ModuleType) -> None:
    assert healthcheck.health_url("0.0.0.0", 9500) == "http://127.0.0.1:9500/healthz"
    assert healthcheck.health_url("127.0.0.1", 1) == "http://127.0.0.1:1/healthz"
    assert healthcheck.health_url("::", 2) == "http://[::1]:2/healthz"
    assert healthcheck.health_url("10.0.0.5", 3) == "http://10.0.0.5:3/healthz"


def test_config_of_a_serve_command_line(healthcheck: ModuleType) -> None:
    config_of = healthcheck.config_of
    assert config_of(
        [
            "/usr/local/bin/python",
            "/usr/local/bin/hicache",
            "serve",
            "--config",
            "/etc/hicache/deploy.yaml",
        ],
        "/app",
    ) == Path("/etc/hicache/deploy.yaml")
    assert config_of(["python", "-m", "hicache", "serve", "--config=c.yaml"], "/app") == Path(
        "/app/c.yaml"
    )
    assert config_of(["hicache", "serve"], "/app") == Path()  # the CLI's default
    assert config_of(["hicache", "demo", "--config", "x"], "/") is None
    assert config_of(["mooncake_master", "--port", "50051"], "/") is None


def test_served_configs_finds_this_containers_sidecar(
    healthcheck: ModuleType, tmp_path: Path
) -> None:
    marker = tmp_path / "marker-config.yaml"
    # a stand-in with a serve command line: same uid and cgroup as this test
    stand_in = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
            "hicache",
            "serve",
            "--config",
            str(marker),
        ]
    )
    try:
        deadline = time.monotonic() + 60  # bounds a hang only (#26: a busy machine)
        while marker not in list(healthcheck.served_configs()):
            assert time.monotonic() < deadline, "the stand-in was not found"
            time.sleep(0.05)
    finally:
        stand_in.kill()
        stand_in.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_healthcheck_against_a_real_sidecar(tmp_path: Path) -> None:
    from hicache.client.process import SidecarProcess

    port = _free_port()
    env = {
        "HICACHE_STORAGE__PATH": str(tmp_path / "l3"),
        "HICACHE_SERVICE__SOCKET_PATH": str(tmp_path / "engine.sock"),
        "HICACHE_SERVICE__HTTP_PORT": str(port),
    }
    config = CONFIGS / "default.yaml"
    script = [sys.executable, str(DOCKER / "healthcheck.py"), str(config)]
    run_env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
    with SidecarProcess(config, env=env, log_path=tmp_path / "s.log"):
        ok = subprocess.run(script, env=run_env, capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
        # the port comes from the config and its overrides: another one is unhealthy
        wrong = {**run_env, "HICACHE_SERVICE__HTTP_PORT": str(_free_port())}
        bad = subprocess.run(script, env=wrong, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1
        assert "unhealthy" in bad.stderr
        # no fixed HTTP port (0: any free one): the engine socket is what is asked
        no_port = {**run_env, "HICACHE_SERVICE__HTTP_PORT": "0"}
        probe = subprocess.run(script, env=no_port, capture_output=True, text=True, timeout=60)
        assert probe.returncode == 0, probe.stderr
