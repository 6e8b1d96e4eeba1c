"""`python -m hicache.testing.serve --copy-faults JSON --config FILE`: the real `hicache serve`
(`hicache.service.app.serve`) on a `FakeCopyBackend` with persistent copy faults, for tests of
what a failed or slow copy looks like from an engine process (a child a test cannot reach into).

Lifecycle: parse the faults (a bad spec is refused before anything starts) -> load the
deployment -> `serve(loaded, backend_factory=...)`, which runs exactly as `hicache serve` does
(ready line, signals, drain, exit 0) with the fake as its copy backend. Errors print as one
line and exit 2, as the CLI's do. `command(faults)` is the argv a `SidecarProcess` runs it by.

The faults, a JSON object (`FakeCopyBackend.from_spec`): `fail_load_layers` (stage-local
positions at which every load walk fails), `load_layer_delay_s` and `backup_layer_delay_s`
(seconds before each layer of a load walk, of a store's backup walk), `backup_hold_path` (backup
walks wait while that file exists). CPU deployments only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from hicache.assembly.sidecar import sidecar_plan
from hicache.config import LoadedConfig, load_deployment
from hicache.errors import ConfigError, HicacheError
from hicache.scheduler import run
from hicache.service.app import serve
from hicache.testing.fake_copies import FakeCopyBackend
from hicache.transfer import CopyBackend

FLAG = "--copy-faults"
WHERE = f"{FLAG} (test-only copy faults)"


def copy_faults(spec: str) -> Callable[[LoadedConfig], CopyBackend]:
    """The backend factory `serve` calls for a deployment: a `FakeCopyBackend` with the faults
    `spec` names, checked now; a deployment whose `device.kind` is not "cpu" is refused."""
    FakeCopyBackend.from_spec(spec, WHERE)  # refused before anything starts

    def factory(loaded: LoadedConfig) -> CopyBackend:
        kind = sidecar_plan(loaded).device_kind
        if kind != "cpu":
            raise ConfigError(
                f"{WHERE} is given but device.kind is {kind!r} "
                f"({loaded.source_of('device.kind')}); the fake copy backend is CPU only"
            )
        return FakeCopyBackend.from_spec(spec, WHERE)

    return factory


def command(faults: Mapping[str, object]) -> list[str]:
    """The argv (before `--config FILE`) that serves with these faults."""
    return [sys.executable, "-m", "hicache.testing.serve", FLAG, json.dumps(faults)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hicache.testing.serve",
        description="hicache serve on a fake copy backend with injected faults (tests only)",
    )
    parser.add_argument(
        FLAG,
        required=True,
        metavar="JSON",
        help="faults as a JSON object, e.g. '{\"fail_load_layers\": [2]}' or "
        "'{\"load_layer_delay_s\": 0.25}'",
    )
    parser.add_argument("--config", required=True, type=Path, help="deployment YAML file")
    args = parser.parse_args(argv)
    try:
        factory = copy_faults(args.copy_faults)
        return run(serve(load_deployment(args.config), backend_factory=factory))
    except HicacheError as exc:
        print(f"hicache: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
