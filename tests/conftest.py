"""Shared fixtures: where the real model configs are, a skip marker for GPU tests, and which
tests share a pytest-xdist worker.

The real configs live in the repository (`configs/models/`), so the suite runs from a fresh
clone with nothing beside it; `shared_model(name)` keeps the name the tests have always used.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
MODEL_CONFIGS = CONFIGS / "models"


def shared_model(name: str) -> Path:
    """A real model's config.json from `configs/models/` (e.g. `lfm2_350m.json`)."""
    path = MODEL_CONFIGS / name
    if not path.exists():
        known = sorted(p.name for p in MODEL_CONFIGS.glob("*.json"))
        pytest.fail(f"real model config {name!r} is not in {MODEL_CONFIGS}; known: {known}")
    return path


# Parts of the longest modules that may run on a worker of their own (pytest-xdist,
# `pytest_xdist_make_scheduler` below): each part is independent of the others (its own
# sidecars and engines; module fixtures such as the reference engines are built once per
# worker that needs them).
# Every other module's tests stay together, in order, on one worker.
SPLIT_MODULES: dict[str, tuple[tuple[str, ...], ...]] = {
    # ~600 s and ~460 s on a 2-vCPU machine (2026-12-03)
    "tests/integrations/test_vllm.py": (
        ("test_hits_from_l2_and_l3_equal_recompute", "test_detector_"),
    ),
}
# tests that may each run on any worker: one demo process per model, nothing shared
EACH_ITS_OWN = ("tests/test_demo.py::test_demo_passes_at_its_defaults_for_every_model[",)


def xdist_group_of(nodeid: str) -> str:
    """The worker group of a test: its module, or the module's part (`SPLIT_MODULES`) whose
    name prefixes it matches (a test in no part goes with the module's rest), or the test
    alone (`EACH_ITS_OWN`)."""
    if nodeid.startswith(EACH_ITS_OWN):
        return nodeid
    module, _, name = nodeid.partition("::")
    for number, prefixes in enumerate(SPLIT_MODULES.get(module, ()), start=1):
        if name.startswith(prefixes):
            return f"{module}:part{number}"
    return module


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Whole modules (or their parts, `xdist_group_of`) to each worker, as `--dist loadfile`
    hands out files. (Not xdist's `--dist loadgroup` marks: under pytest 9.2 and xdist 3.8
    three tests of one `xdist_group` ran on two workers.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleParts(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    return ModuleParts(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
