"""Print the `podman build -v` options that give a build this machine's pip configuration:
pip's own config files (`pip config debug`: global, site, user, and the files PIP_CONFIG_FILE
names), the CA bundle and constraint files they name, and the local folders of their
`find-links` / `file://` index URLs, each mounted read-only at its own path. .ci/run passes
them to `podman build` so pip inside the build installs as pip does on this host; on a machine
whose pip needs no configuration this prints only what exists (possibly nothing)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def main() -> int:
    debug = subprocess.run(
        [sys.executable, "-m", "pip", "config", "debug"], capture_output=True, text=True
    ).stdout
    files = [Path(p) for p in re.findall(r"^\s+(/\S+), exists: True$", debug, re.M)]
    values = re.findall(r"^\s+\S+: (.+)$", debug, re.M)
    values += [v for k, v in os.environ.items() if k.startswith("PIP_")]
    paths: set[Path] = set()
    for f in files:  # the folder, so a config's sibling files (constraints) come along
        paths.add(f.parent if f.parent.name == "pip" else f)
    for value in values:
        for word in value.strip("'\"").split():
            word = word.removeprefix("file://")
            if word.startswith("/") and Path(word).exists():
                path = Path(word)
                # an index's `simple` folder: mount its parent, whose files it links to
                paths.add(path.parent if path.name == "simple" else path)
    for path in sorted(paths):
        if not any(other != path and other in path.parents for other in paths):
            print(f"-v={path}:{path}:ro")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
