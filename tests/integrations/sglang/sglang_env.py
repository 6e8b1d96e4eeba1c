"""Where the SGLang tests find SGLang, and the environment its processes run in.

SGLang lives in a virtual environment of its own (`.venv-sglang/` at the repository root,
built by `python3 dev.py setup --sglang-kernel DIR`; docs/design.md, "SGLang's own
environment"), or wherever `$SGLANG_TEST_PYTHON` points (a python with sglang 0.5.23, its CPU
kernel and hicache's dependencies). The tests run in the main environment and start SGLang
processes with that python: hicache comes from this checkout (`PYTHONPATH`), the CPU stand-ins
from `cpu_site/` (never installed anywhere).

Neither present: the SGLang modules skip, naming what is missing; `_HICACHE_REQUIRE_SGLANG=1`
(`dev.py test` sets it when it built the environment) turns that skip into a failure.
Variables are not `HICACHE_*`: that prefix is read by every `hicache serve` as config.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CPU_SITE = Path(__file__).resolve().parent / "cpu_site"
PYTHON_ENV = "SGLANG_TEST_PYTHON"
REQUIRE_ENV = "_HICACHE_REQUIRE_SGLANG"
SGLANG_VERSION = "0.5.23"


def _candidate(env: Mapping[str, str]) -> tuple[Path, str]:
    if env.get(PYTHON_ENV):
        return Path(env[PYTHON_ENV]), f"${PYTHON_ENV}"
    return ROOT / ".venv-sglang" / "bin" / "python", "the repository's .venv-sglang"


@cache
def missing_reason() -> str | None:
    """Why SGLang cannot run here, or None when it can: the python, sglang at the pinned
    version and its CPU kernel are all checked in one short subprocess."""
    python, where = _candidate(os.environ)
    if not python.exists():
        return (
            f"no SGLang environment: {python} ({where}) does not exist; build it with "
            "`python3 dev.py setup --sglang-kernel DIR` (DIR: a folder holding the "
            f"sglang_kernel_cpu wheel) or point ${PYTHON_ENV} at a python with sglang "
            f"{SGLANG_VERSION}"
        )
    probe = (
        "import importlib.metadata as m, sys; "
        "v = m.version('sglang'); k = m.version('sglang-kernel-cpu'); print(v, k)"
    )
    done = subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{python} ({where}) lacks sglang or its CPU kernel sglang-kernel-cpu: {last}"
    version = done.stdout.split()[0]
    if version != SGLANG_VERSION:
        return f"{python} ({where}) has sglang {version}; the tests pin {SGLANG_VERSION}"
    return None


def require_sglang() -> Path:
    """The SGLang python, or skip (fail where `_HICACHE_REQUIRE_SGLANG` is set) saying why."""
    reason = missing_reason()
    if reason is not None:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set (dev.py built the SGLang environment) but {reason}")
        pytest.skip(reason)
    return _candidate(os.environ)[0]


def sglang_environ(
    extra: Mapping[str, str] | None = None, *, cpu_shims: bool = True
) -> dict[str, str]:
    """The environment of an SGLang process: this checkout's hicache and `cpu_site` first on
    the path, SGLang's CPU engine, no network, and `extra` on top. `cpu_shims`: install the
    HiCache host-pool stand-ins in every process (the engine's scheduler included)."""
    env = dict(os.environ)
    path = [str(CPU_SITE), str(ROOT)]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(path),
            "SGLANG_USE_CPU_ENGINE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONWARNINGS": "ignore",
            "_HICACHE_SGLANG_CPU_SHIMS": "1" if cpu_shims else "0",
        }
    )
    env.update(extra or {})
    return env
