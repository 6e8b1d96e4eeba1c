"""How bytes move: copy backends behind one interface (CPU worker thread; CUDA streams and
events), the per-layer copy plan, and the layer-done counter. The only package that touches
`torch.cuda` (in cuda_backend.py)."""

from __future__ import annotations

from hicache.transfer.backend import (
    NO_FENCE,
    READY,
    CancelToken,
    CopyBackend,
    CopyCancelled,
    Direction,
    Fence,
    LayerFailure,
    LayerListener,
    LayerPart,
    RowCopy,
    StopKind,
    WalkSignals,
)
from hicache.transfer.counter import (
    NOOP_COUNTER,
    CounterRing,
    LayerDoneCounter,
    LoadCounter,
    StoppedCounter,
)
from hicache.transfer.cpu_backend import CpuCopyBackend
from hicache.transfer.plan import GroupMove, copy_layers_blocking
from hicache.transfer.rows import Rows

__all__ = [
    "NOOP_COUNTER",
    "NO_FENCE",
    "READY",
    "CancelToken",
    "CopyBackend",
    "CopyCancelled",
    "CounterRing",
    "CpuCopyBackend",
    "Direction",
    "Fence",
    "GroupMove",
    "LayerDoneCounter",
    "LayerFailure",
    "LayerListener",
    "LayerPart",
    "LoadCounter",
    "RowCopy",
    "Rows",
    "StopKind",
    "StoppedCounter",
    "WalkSignals",
    "copy_layers_blocking",
    "make_backend",
]


def make_backend(
    kind: str, index: int = 0, pin_chunk_bytes: int = 64 * 2**30, *, prefault: bool = True
) -> CopyBackend:
    """The backend for `device.kind`: "cpu", or "cuda" (needs a CUDA device). `prefault`:
    the CPU backend touches every host page at allocation (CUDA always does, before pinning).
    """
    if kind == "cuda":
        from hicache.transfer.cuda_backend import CudaCopyBackend

        return CudaCopyBackend(index, pin_chunk_bytes=pin_chunk_bytes)
    return CpuCopyBackend(prefault=prefault)
