"""The CPU image, built by .ci/run and run for real with podman (issue #34): the README's
container commands, run as written, serve an engine process on the host; the demo passes inside
the container; both compose deployments come up healthy with podman-compose and serve a host
engine, and after the sidecar container restarts both give it L3 hits (Redis; the Mooncake
Store's memory held by its own `mooncake_client` service, the sidecar mounting none); the
image is non-root and a second container of it cannot reach the first's engines.

Needs root, podman, podman-compose and the image: .ci/run builds it and exports its name as
CI_HICACHE_IMAGE (CI_REDIS_IMAGE: an image with redis-server for compose's `redis`,
CI_PODMAN_COMPOSE: the podman-compose to run); the module skips saying which is
missing. podman's settings for the machine (runtime, ulimits) come from CONTAINERS_CONF.

The sidecar container's lifecycle, as the tests drive it: created (`podman run -d`) ->
starting (its HEALTHCHECK not yet passed) -> healthy (`podman healthcheck run` runs the image's
HEALTHCHECK; the deadline to get there is derived from how long the container took to
start answering the first time) -> serving host engines -> restarted (SIGTERM: it drains its
L3 writes and exits; L2 is lost, L3 stays) -> healthy again -> removed. Compose adds: L3
server healthy before the sidecar starts (podman-compose waits on `service_healthy`), and
`down` removes every container and the network; with Mooncake, the store's memory holder
(`mooncake-store`) passes its HEALTHCHECK before the engine runs (until it has mounted its
memory the store has no room and L3 writes are refused as not stored).

The engine on the host is the demo's synthetic engine (`python -m hicache.demo.engine`): it
stores, loads and checks every byte it loaded against what its token prefix determines, and
runs as the image's uid (the socket is 0600 and the sidecar opens its memfds by /proc).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.containers

IMAGE = os.environ.get("CI_HICACHE_IMAGE", "")
REDIS_IMAGE = os.environ.get("CI_REDIS_IMAGE", "")
PODMAN_COMPOSE = os.environ.get("CI_PODMAN_COMPOSE", "")
TRACE = ["--conversations", "2", "--turns", "2", "--cold-requests", "1", "--device-pages", "64"]
TOKEN = "container-test-token"


def _why_not() -> str:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (podman's rootful storage, and engines run as the image's uid)"
    if shutil.which("podman") is None:
        return "podman is not installed (.ci/run installs it as root)"
    if not IMAGE:
        return "CI_HICACHE_IMAGE is not set: .ci/run builds the CPU image and exports its name"
    if subprocess.run(["podman", "image", "exists", IMAGE], check=False).returncode != 0:
        return f"CI_HICACHE_IMAGE={IMAGE} names no image podman has: run .ci/run"
    if not PODMAN_COMPOSE or not os.access(PODMAN_COMPOSE, os.X_OK):
        return f"CI_PODMAN_COMPOSE={PODMAN_COMPOSE!r} is no podman-compose to run"
    return ""


if _why_not():
    pytest.skip(_why_not(), allow_module_level=True)


def podman(
    *args: str, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {shlex.join(args)}: exit {done.returncode}\n{done.stderr}")
    return done


def readme_block(name: str) -> list[str]:
    """The README's `<!-- example: NAME -->` bash block, one command a line."""
    text = (REPO / "README.md").read_text()
    match = re.search(rf"<!-- example: {name} -->\n```bash\n(.*?)```", text, re.S)
    assert match, f"README lost its {name} example"
    return [line.split("  # ")[0].strip() for line in match.group(1).splitlines() if line.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Host:
    """The engines' side: their uid (the image's), socket folder, environment and commands."""

    def __init__(self, uid: int, gid: int, folder: Path, name: str = "host"):
        self.uid, self.gid, self.folder = uid, gid, folder
        self.socket_dir = folder / name / "sock"
        self.home = folder / name / "home"
        (folder / name).mkdir(mode=0o755)
        for path in (self.socket_dir, self.home):
            path.mkdir(mode=0o700)
            os.chown(path, uid, gid)
        # the compose project (containers, network) of this host's deployment
        self.project = f"hicache-ci-{name}-{os.getpid()}"
        self.settings = {
            "ENGINE_UID": str(uid),
            "ENGINE_GID": str(gid),
            "ENGINE_SOCKET_DIR": str(self.socket_dir),
            "SIDECAR_HTTP_PORT": str(free_port()),
            "SIDECAR_TOKEN": TOKEN,
        }

    def shell(self, command: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """A README command as written, with this host's settings in the environment."""
        env = {**os.environ, **self.settings, "COMPOSE_PROJECT_NAME": self.project}
        if REDIS_IMAGE:
            env["REDIS_IMAGE"] = REDIS_IMAGE
        if command.startswith("podman-compose "):
            command = shlex.quote(PODMAN_COMPOSE) + command[len("podman-compose") :]
        return subprocess.run(
            ["bash", "-euc", command],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def engine(self, config: Path) -> dict[str, Any]:
        """The synthetic engine, as the image's uid, on this host's socket: its summary."""
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "hicache.demo.engine",
                "--config",
                str(config),
                "--socket",
                str(self.socket_dir / "engine.sock"),
                *TRACE,
            ],
            cwd=self.home,
            env={
                **os.environ,
                "PYTHONPATH": str(REPO),
                "HOME": str(self.home),
                "HICACHE_SERVICE__TOKEN": TOKEN,
            },
            user=self.uid,
            group=self.gid,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        events = [json.loads(line) for line in done.stdout.splitlines()]
        (summary,) = [e for e in events if e["event"] == "summary"]
        return dict(summary)


def wait_healthy(container: str, since: str) -> None:
    """Follow the container's log (from `since`, an RFC 3339 time) to the sidecar's ready
    line, then run the image's HEALTHCHECK (`podman healthcheck run`), which must pass: podman
    then reports the container healthy. A container that exits first fails here with its log;
    180 s is the guard against a hang, not the expected time."""
    follow = subprocess.Popen(
        ["podman", "logs", "--follow", "--since", since, container],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []
    guard = threading.Timer(180, follow.kill)
    guard.start()
    try:
        assert follow.stdout is not None
        for line in follow.stdout:
            seen.append(line)
            if line.startswith("hicache serve: ready"):
                break
        else:
            raise AssertionError(f"{container} stopped before it was ready:\n{''.join(seen)}")
    finally:
        guard.cancel()
        follow.kill()
        follow.wait()
    check = podman("healthcheck", "run", container, check=False, timeout=60)
    assert check.returncode == 0, f"{container}: HEALTHCHECK failed: {check.stdout}{check.stderr}"
    status = podman("inspect", "--format", "{{.State.Health.Status}}", container)
    assert status.stdout.strip() == "healthy"


def check_passes(container: str, timeout_s: float = 120.0) -> None:
    """Run the container's HEALTHCHECK until it passes; `timeout_s` guards against a hang."""
    deadline = time.monotonic() + timeout_s
    while True:
        check = podman("healthcheck", "run", container, check=False, timeout=60)
        if check.returncode == 0:
            return
        assert time.monotonic() < deadline, f"{container}: {check.stdout}{check.stderr}"
        time.sleep(1)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1))


def test_every_readme_container_line_is_one_that_ci_runs() -> None:
    """The README's block, line by line: the settings (the tests give their own, same names),
    the build (.ci/run's, plus where CI's machine gets its base and packages), the socket
    folder (made by `Host` as the line says), then the lines the tests below run verbatim."""
    settings, build, install, run, health, demo, export, *ups = readme_block("containers")
    names = ["ENGINE_UID", "ENGINE_GID", "ENGINE_SOCKET_DIR", "SIDECAR_HTTP_PORT", "SIDECAR_TOKEN"]
    assert re.findall(r"(\w+)=", settings) == names
    assert export == "export " + " ".join(names)
    assert build == (
        "podman build --format docker -f docker/Dockerfile.cpu -t hicache:cpu "
        "--build-arg UID=$ENGINE_UID --build-arg GID=$ENGINE_GID ."
    )
    ci = (REPO / ".ci" / "run").read_text()
    assert "podman build -q --format docker " in ci
    assert "-f docker/Dockerfile.cpu -t hicache:cpu --build-arg UID=" in ci
    ids = {
        podman("image", "inspect", "--format", "{{.Id}}", i).stdout for i in (IMAGE, "hicache:cpu")
    }
    assert len(ids) == 1, f"{IMAGE} is not the README's hicache:cpu"
    assert install == "install -d -o $ENGINE_UID -g $ENGINE_GID -m 0700 $ENGINE_SOCKET_DIR"
    assert run.startswith(
        "podman run -d --name hicache --stop-timeout 30 --pid=host --user $ENGINE_UID:$ENGINE_GID "
    )  # 30 s from SIGTERM to SIGKILL: the drain's whole budget and more (tests/test_docker.py)
    assert health == "podman healthcheck run hicache"  # what wait_healthy runs
    assert demo == "podman run --rm hicache:cpu demo"
    assert [u.split(" up -d")[0] for u in ups] == [
        "podman-compose -f docker/compose.yaml",
        "podman-compose -f docker/compose.yaml -f docker/compose.mooncake.yaml",
    ]


@pytest.fixture(scope="module")
def image_uid() -> tuple[int, int]:
    """The image runs as a non-root user: its uid and gid, asked of the image itself."""
    assert podman("image", "inspect", "--format", "{{.Config.User}}", IMAGE).stdout.strip() == (
        "hicache"
    )
    ids = podman("run", "--rm", "--entrypoint", "id", IMAGE).stdout
    match = re.match(r"uid=(\d+)\(hicache\) gid=(\d+)\(hicache\)", ids)
    assert match, ids
    uid, gid = int(match.group(1)), int(match.group(2))
    assert uid != 0
    return uid, gid


@pytest.fixture(scope="module")
def host(image_uid: tuple[int, int]) -> Iterator[Host]:
    folder = Path(tempfile.mkdtemp(prefix="hicache-containers-"))
    os.chmod(folder, 0o755)  # the engines' uid walks into its folders
    uid, gid = image_uid
    probe = subprocess.run(
        [sys.executable, "-c", "import hicache.demo.engine"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd="/",
        user=uid,
        group=gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert probe.returncode == 0, (
        f"the host engines run as the image's uid {uid}, which cannot run {sys.executable} "
        f"on the checkout {REPO}: {probe.stderr.strip().splitlines()[-1:]}; run .ci/run from "
        "a checkout (and a venv) every user can read, e.g. not under a 0700 home folder"
    )
    try:
        yield Host(uid, gid, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def demo_inside() -> Iterator[subprocess.Popen[str]]:
    """`podman run --rm IMAGE demo`, the README's command, started first: it runs beside the
    other tests and is checked by the last one."""
    (command,) = [c for c in readme_block("containers") if c.endswith(" demo")]
    proc = subprocess.Popen(
        ["bash", "-euc", command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    yield proc
    if proc.poll() is None:  # SIGTERM: `podman run` passes it on, --rm removes the container
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


@pytest.fixture(scope="module")
def sidecar(host: Host, demo_inside: subprocess.Popen[str]) -> Iterator[str]:
    """The README's `podman run -d --name hicache ...`, run as written, until healthy."""
    (command,) = [c for c in readme_block("containers") if c.startswith("podman run -d ")]
    name = re.search(r"--name (\S+)", command).group(1)  # type: ignore[union-attr]
    podman("rm", "--force", "--ignore", name)
    since = now()
    started = host.shell(command)
    assert started.returncode == 0, started.stderr
    try:
        wait_healthy(name, since)
        yield name
    finally:
        podman("rm", "--force", "--ignore", name)


def test_the_documented_sidecar_container_serves_a_host_engine_every_byte_verified(
    host: Host, sidecar: str
) -> None:
    summary = host.engine(REPO / "configs" / "default.yaml")
    assert summary["mismatches"] == 0
    assert summary["loads"] > 0
    assert summary["tokens_l2"] + summary["tokens_l3"] > 0
    assert summary["pages_verified"] > 0
    assert summary["bytes_verified"] > 0
    # the sidecar in the container served it: its engine socket is in the host's folder
    sock = host.socket_dir / "engine.sock"
    assert sock.is_socket()
    assert sock.stat().st_uid == host.uid
    # /healthz through the published port too, as the README says
    port = host.settings["SIDECAR_HTTP_PORT"]
    curl = subprocess.run(
        [
            "python3",
            "-c",
            f"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{port}/healthz', timeout=5).status)",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert curl.stdout.strip() == "200", curl.stderr


def test_a_second_container_of_the_image_cannot_reach_the_first_ones_engines(
    host: Host, sidecar: str
) -> None:
    """An engine attached to the first sidecar; a second container of the same image, started
    without the first's socket folder (its own pid namespace, as podman gives by default),
    finds neither the engine's socket nor its process, and even with the host's pids
    (--pid=host) but another uid the kernel refuses it the engine's memfds."""
    engine = subprocess.Popen(
        ["sleep", "120"], user=host.uid, group=host.gid, extra_groups=[]
    )  # an engine process of the engines' uid, holding an open descriptor
    try:
        probe = (
            "import os, socket, sys\n"
            f"pid = {engine.pid}\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            "    s.connect('/run/hicache/engine.sock'); print('socket: reached')\n"
            "except OSError as e:\n"
            "    print('socket:', type(e).__name__)\n"
            "try:\n"
            "    os.listdir(f'/proc/{pid}/fd'); print('fds: reached')\n"
            "except OSError as e:\n"
            "    print('fds:', type(e).__name__)\n"
        )
        alone = podman("run", "--rm", "--entrypoint", "python", IMAGE, "-c", probe)
        assert alone.stdout.splitlines() == [
            "socket: FileNotFoundError",
            "fds: FileNotFoundError",
        ]
        other_uid = podman(
            "run", "--rm", "--pid=host", "--user", f"{host.uid + 1}:{host.gid + 1}",
            "--entrypoint", "python", IMAGE, "-c", probe,
        )  # fmt: skip
        assert other_uid.stdout.splitlines() == [
            "socket: FileNotFoundError",
            "fds: PermissionError",
        ]
    finally:
        engine.kill()
        engine.wait()


COMPOSE_VARIANTS = {"redis": "compose.yaml", "mooncake": "compose-mooncake.yaml"}


def test_compose_deployments_come_up_healthy_and_survive_a_sidecar_restart(
    image_uid: tuple[int, int], host: Host, demo_inside: subprocess.Popen[str]
) -> None:
    """Both compose deployments at once (each its own project, socket folder and port): the
    README's `podman-compose ... up -d`, the sidecar healthy after its L3 server, a host engine
    served (every byte verified, its pages written to L3), the sidecar container restarted (L2
    gone), the same trace again: its hits now come from L3, in both. A Mooncake Store keeps
    each object in the memory segment of a client (docs/deployment.md); the compose file's
    `mooncake-store` holds it and the sidecar mounts none, so the sidecar's restart takes
    nothing along (tests/storage/test_mooncake_segment_holder.py shows a sidecar with a
    segment of its own losing the objects placed in it)."""
    if not REDIS_IMAGE:
        pytest.skip("CI_REDIS_IMAGE is not set (.ci/run builds one with redis-server)")
    ups = [c for c in readme_block("containers") if c.startswith("podman-compose ")]
    assert [("compose.mooncake.yaml" in c, c.endswith(" up -d")) for c in ups] == [
        (False, True),
        (True, True),
    ]
    hosts = {v: Host(*image_uid, host.folder, name=v) for v in COMPOSE_VARIANTS}
    with ThreadPoolExecutor(len(hosts)) as pool:
        runs = {
            variant: pool.submit(_compose_round_trip, hosts[variant], up, REPO / "configs" / config)
            for (variant, config), up in zip(COMPOSE_VARIANTS.items(), ups, strict=True)
        }
    results = {variant: run.result() for variant, run in runs.items()}
    for variant, (first, second) in results.items():
        assert first["mismatches"] == 0, variant
        assert first["bytes_verified"] > 0, variant
        assert first["sidecar"]["persist"]["failed_pages"] == 0, (variant, first["sidecar"])
        assert first["sidecar"]["persist"]["written_pages"] > 0, (variant, first["sidecar"])
        assert second["mismatches"] == 0, variant
        # every page pass 1 wrote outlived the restart in L3, readable and intact. Pages that
        # reached L2 after a load's prefetch deadline (`load_failed_pages`: the timeout
        # policy fetches them on in the background and the engine recomputes them) are
        # latency, not loss: CI's busy machine had 12 late once (stop 41), none missing
        l3 = second["sidecar"]["l3"]
        health = ("misses", "failures", "corrupt_dropped", "objects_damaged", "breaker")
        assert [l3[k] for k in health] == [0, {}, 0, 0, "closed"], (variant, l3)
        known = sum(g["l3_pages_known"] for g in second["sidecar"]["groups"].values())
        assert known == first["sidecar"]["persist"]["offered_pages"], (variant, second["sidecar"])
    for variant, (_, second) in results.items():
        assert second["tokens_l3"] > 0, (variant, json.dumps(second))
        assert second["bytes_verified"] > 0, variant


def _compose_round_trip(host: Host, up: str, config: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    files = up[len("podman-compose ") : -len(" up -d")]
    down = f"podman-compose {files} down --volumes --timeout 10"
    host.shell(down)  # a previous run's leftovers
    try:
        since = now()
        started = host.shell(up, timeout=300)
        assert started.returncode == 0, started.stdout + started.stderr
        sidecar = _compose_container(host, files, "hicache")
        wait_healthy(sidecar, since)
        if "compose.mooncake.yaml" in files:
            check_passes(_compose_container(host, files, "mooncake-store"))
        first = host.engine(config)
        since = now()
        restarted = host.shell(f"podman-compose {files} restart hicache")
        assert restarted.returncode == 0, restarted.stderr
        wait_healthy(sidecar, since)
        second = host.engine(config)  # L1 and L2 are new: the hits are L3's
        return first, second
    finally:
        host.shell(down)


def _compose_container(host: Host, files: str, service: str) -> str:
    listed = host.shell(f"podman-compose {files} ps --format json")
    assert listed.returncode == 0, listed.stderr
    for entry in json.loads(listed.stdout or "[]"):
        if entry.get("Labels", {}).get("com.docker.compose.service") == service:
            return str(entry["Names"][0])
    raise AssertionError(f"no {service} container in {listed.stdout}")


def test_the_demo_passes_inside_the_container(demo_inside: subprocess.Popen[str]) -> None:
    out, err = demo_inside.communicate(timeout=600)
    assert demo_inside.returncode == 0, err[-3000:] + out[-3000:]
    assert "mismatches: 0" in out
