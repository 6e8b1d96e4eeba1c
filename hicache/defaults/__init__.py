"""The default deployment shipped inside the package, so a wheel or an image runs a bare
`hicache serve` / `hicache demo`: `default.yaml` and the model config.json it names.

`default.yaml` is generated from the repository's `configs/default.yaml` (the user-facing
file) by `packaged_text`: the same deployment, with its two state paths (the file L3 and the
engine socket), which the repository's file puts beside the repository, moved under
`~/.cache/hicache` (a package directory is no place to write). Regenerate it with
`python -m hicache.defaults configs/default.yaml`; a test checks the two agree.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

# the repository file's lines -> the packaged file's (everything else is copied as is)
_STATE_PATHS = {
    "  path: ../.hicache/l3           # relative to this file": (
        "  path: ~/.cache/hicache/l3      # the packaged default's L3 (any writable directory)"
    ),
    "  socket_path: ../.hicache/engine.sock": "  socket_path: ~/.cache/hicache/engine.sock",
}
_HEADER = (
    "# GENERATED from configs/default.yaml by `python -m hicache.defaults configs/default.yaml`"
    " (do not edit):\n# the same deployment, its state paths under ~/.cache/hicache.\n"
)


def default_config_path() -> Path:
    """The packaged `default.yaml` (inside the installed package, not a repository)."""
    return Path(str(files("hicache.defaults") / "default.yaml"))


def packaged_text(repo_text: str) -> str:
    """The packaged default from the repository's `configs/default.yaml` text."""
    lines = repo_text.splitlines(keepends=True)
    out, found = [], set()
    for line in lines:
        key = line.rstrip("\n")
        if key in _STATE_PATHS:
            found.add(key)
            line = _STATE_PATHS[key] + "\n"
        out.append(line)
    missing = set(_STATE_PATHS) - found
    if missing:
        raise ValueError(
            f"configs/default.yaml lacks the state-path lines {sorted(missing)}; update "
            "hicache/defaults/__init__.py's _STATE_PATHS to match it"
        )
    return _HEADER + "".join(out)
