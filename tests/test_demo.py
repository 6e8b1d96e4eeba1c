"""The demo's round trip verifies what it loads: a corrupting backend is caught."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from hicache.config import load_deployment
from hicache.demo import _round_trip, run_demo
from hicache.embedded import EmbeddedCache
from hicache.scheduler import run
from hicache.transfer import CpuCopyBackend, Direction, LayerPart
from tests.conftest import CONFIGS


class CorruptingBackend(CpuCopyBackend):
    """Copies, then flips one byte of the first destination row of every load layer."""

    def _run_layer(self, direction: Direction, position: int, parts: Sequence[LayerPart]) -> None:
        super()._run_layer(direction, position, parts)
        if direction is Direction.LOAD:
            for source, local_id in parts:
                for _, _, dst, dst_rows in source.row_pairs(direction, local_id):
                    row = dst_rows.ids()[0]
                    dst[row, 0] ^= 0xFF


@pytest.fixture
def loaded():  # type: ignore[no-untyped-def]
    return load_deployment(
        CONFIGS / "default.yaml",
        env={
            "HICACHE_DEVICE__POOL_CAPACITY_BYTES": "8MiB",
            "HICACHE_HOST__CAPACITY_BYTES": "16MiB",
        },
    )


def test_demo_round_trip_verifies_every_byte(loaded) -> None:  # type: ignore[no-untyped-def]
    assert run_demo(loaded) == 0


def test_demo_catches_corruption(loaded) -> None:  # type: ignore[no-untyped-def]
    d = loaded.deployment
    from hicache.memory import torch_dtype

    cache = EmbeddedCache.build(
        loaded.layer_map(),
        dtype=torch_dtype(d.model.dtype),
        page_size_tokens=d.model.page_size_tokens,
        host_capacity_bytes=d.host.capacity_bytes,
        device_pages=10,
        backend=CorruptingBackend(),
    )
    try:
        summary = run(_round_trip(cache))
    finally:
        cache.close()
    assert summary.bytes_verified > 0
    assert summary.mismatches > 0
