"""Shared fixtures: where the real model configs are, and a skip marker for GPU tests."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_MODELS = REPO.parent / "shared" / "models"
CONFIGS = REPO / "configs"


def shared_model(name: str) -> Path:
    path = SHARED_MODELS / name
    if not path.exists():
        pytest.fail(f"real model config {path} is missing: the tests need ../shared/models")
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
