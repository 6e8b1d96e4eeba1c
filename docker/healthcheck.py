"""Docker HEALTHCHECK of `hicache serve`: GET /healthz where the sidecar really listens.

No port is written here: it is the deployment's `service.http_host` / `service.http_port`, read
as `hicache serve` reads them (the config file, then this container's `HICACHE_*` overrides,
which a healthcheck shares with the container's main process). The config file is

  1. the first argument (compose passes the file it mounts), else
  2. the `--config` of the `hicache serve` process of this container (same uid, same cgroup:
     found under `pid: host` too, where that process is not pid 1), else
  3. the CLI's default (the packaged default.yaml).

Exit 0 when /healthz answers 200 (where the config has no HTTP port: when the engine socket
accepts a connection), else 1 with the reason on stderr (`docker inspect` shows it).
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def config_of(argv: list[str], cwd: str) -> Path | None:
    """The `--config` of a `hicache serve` command line (relative to its cwd), the default
    path's stand-in `Path()` when it names none, None when it is no `hicache serve`."""
    names = [Path(a).name for a in argv]
    is_hicache = "hicache" in names or any(
        a == "-m" and b == "hicache" for a, b in itertools.pairwise(argv)
    )
    if not is_hicache or "serve" not in argv:
        return None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(cwd, argv[i + 1])
        if arg.startswith("--config="):
            return Path(cwd, arg.split("=", 1)[1])
    return Path()


def served_configs(proc: Path = Path("/proc")) -> Iterator[Path]:
    """The configs of the `hicache serve` processes of this container (one, in a container)."""
    own_cgroup = _read(str(proc / "self" / "cgroup"))
    uid = os.getuid()
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != uid or _read(str(entry / "cgroup")) != own_cgroup:
                continue
            argv = [a.decode() for a in _read(str(entry / "cmdline")).split(b"\0") if a]
            config = config_of(argv, os.readlink(entry / "cwd"))
        except (OSError, UnicodeDecodeError):
            continue
        if config is not None:
            yield config


def health_url(host: str, port: int) -> str:
    """Where to ask: a wildcard listener is asked on loopback."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/healthz"


def main(argv: list[str]) -> int:
    from hicache.config import load_deployment

    config = Path(argv[0]) if argv else next(served_configs(), None)
    try:
        if config is None or config == Path():  # none found, or one on the CLI's default
            from hicache.cli.main import DEFAULT_CONFIG

            config = DEFAULT_CONFIG
        service = load_deployment(config, env=os.environ).deployment.service
        if not service.http_port:  # no HTTP API (or an ephemeral port): the engine socket
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(2)
                probe.connect(str(service.socket_path))
            return 0
        url = health_url(service.http_host, service.http_port)
        with urllib.request.urlopen(url, timeout=2) as reply:
            if reply.status == 200:
                return 0
            print(f"{url}: HTTP {reply.status}", file=sys.stderr)
    except Exception as exc:  # any failure is "unhealthy", with its reason
        print(f"unhealthy ({config}): {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
