"""Shared fixtures: where the real model configs are, and a skip marker for GPU tests.

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
