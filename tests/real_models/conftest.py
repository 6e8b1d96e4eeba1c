"""Fixtures for the real-model tests: each family's tiny model, built once per session.

transformers is imported lazily (the test modules `importorskip` it), so without it the
directory skips cleanly instead of failing to collect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.real_models.harness import Zoo


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Zoo:
    from tests.real_models.harness import Zoo

    return Zoo(tmp_path_factory.mktemp("tiny_models"))
