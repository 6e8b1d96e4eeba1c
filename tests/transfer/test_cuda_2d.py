"""The 2-D copy that moves a run of page_first host rows in one CUDA call: what it passes to
`cudaMemcpy2DAsync` (checked against a recording stand-in, since this is pointer
arithmetic), what it refuses, and, on a GPU, that the backend found the real function."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hicache.errors import TransferError
from hicache.transfer.cuda_2d import Memcpy2D


class Recorder:
    def __init__(self, status: int = 0):
        self.calls: list[tuple[Any, ...]] = []
        self.status = status

    def __call__(self, *args: Any) -> int:
        self.calls.append(args)
        return self.status


STREAM: Any = SimpleNamespace(cuda_stream=0xABC)


def test_a_strided_run_is_one_call_with_both_pitches() -> None:
    host = torch.zeros(10 * 96, dtype=torch.uint8)
    strided = host.as_strided((4, 32), (96, 1), 64)  # rows 96 bytes apart, from byte 64
    stage = torch.zeros(4 * 32, dtype=torch.uint8).view(4, 32)
    record = Recorder()
    Memcpy2D(record).copy(stage, strided, STREAM)
    assert record.calls == [
        (stage.data_ptr(), 32, host.data_ptr() + 64, 96, 32, 4, 4, 0xABC)  # 4: cudaMemcpyDefault
    ]


def test_a_single_row_uses_its_width_as_pitch() -> None:
    host = torch.zeros(200, dtype=torch.uint8)
    one = host.as_strided((1, 32), (7, 1), 10)  # a pitch under the width would be refused
    stage = torch.zeros(1, 32, dtype=torch.uint8)
    record = Recorder()
    Memcpy2D(record).copy(one, stage, STREAM)
    assert record.calls[0][1] == 32
    assert record.calls[0][3] == 32


def test_nothing_to_copy_makes_no_call() -> None:
    record = Recorder()
    empty = torch.zeros(0, 16, dtype=torch.uint8)
    Memcpy2D(record).copy(empty, empty, STREAM)
    assert record.calls == []


def test_shapes_that_differ_or_strided_bytes_are_refused() -> None:
    record = Recorder()
    with pytest.raises(TransferError, match=r"\(3, 16\) stride \(16, 1\) -> \(2, 16\)"):
        Memcpy2D(record).copy(
            torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, 16, dtype=torch.uint8), STREAM
        )
    columns = torch.zeros(16, 4, dtype=torch.uint8).t()  # bytes of a row are 4 apart
    with pytest.raises(TransferError, match="contiguous rows"):
        Memcpy2D(record).copy(torch.zeros(4, 16, dtype=torch.uint8), columns, STREAM)
    assert record.calls == []


def test_a_cuda_error_is_raised_with_its_code() -> None:
    stage = torch.zeros(2, 8, dtype=torch.uint8)
    with pytest.raises(TransferError, match="2 rows of 8 bytes failed with CUDA error 1"):
        Memcpy2D(Recorder(status=1)).copy(stage, stage.clone(), STREAM)


@pytest.mark.gpu
def test_the_cuda_backend_finds_the_runtime_function() -> None:
    from hicache.transfer.cuda_backend import CudaCopyBackend

    backend = CudaCopyBackend(0, staging_bytes=2**20)
    try:
        assert backend._memcpy_2d is not None  # else page_first copies go one page at a time
    finally:
        backend.close()
