"""Run at start by every Python process with this folder on its path (the SGLang processes
the tests start, the engine's spawned scheduler included); see README.md.

    _HICACHE_SGLANG_CPU_SHIMS=1      install hicache_sglang_cpu_shims
    _HICACHE_SGLANG_PAUSE_IN=M:Q     the function Q (`Class.method`) of module M stops forever
    _HICACHE_SGLANG_PAUSE_ARM=PATH   ... once PATH exists (the test arms it when it wants),
    _HICACHE_SGLANG_PAUSE_ANNOUNCE=PATH  writing PATH first, so the test knows where it is
"""

import importlib
import os
import time
from pathlib import Path


def _pause(spec: str, arm: Path, announce: Path) -> None:
    module_name, _, qualname = spec.partition(":")
    owner: object = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)

    def paused(*args: object, **kwargs: object) -> object:
        if arm.exists():
            announce.write_text(f"in {spec} (pid {os.getpid()})")
            while True:
                time.sleep(3600)
        return original(*args, **kwargs)

    setattr(owner, name, paused)


if os.environ.get("_HICACHE_SGLANG_CPU_SHIMS") == "1":
    import hicache_sglang_cpu_shims

    hicache_sglang_cpu_shims.install()
if os.environ.get("_HICACHE_SGLANG_PAUSE_IN"):
    _pause(
        os.environ["_HICACHE_SGLANG_PAUSE_IN"],
        Path(os.environ["_HICACHE_SGLANG_PAUSE_ARM"]),
        Path(os.environ["_HICACHE_SGLANG_PAUSE_ANNOUNCE"]),
    )
