"""Strided page copies between pinned host rows and device staging, one call per run.

A page_first host pool keeps one layer's rows a whole page apart, so a run of pages is not
one contiguous range, and torch's `copy_` between a strided host view and the device first
makes a contiguous host temporary, synchronously. `cudaMemcpy2DAsync` moves `height` rows
of `width` bytes between two pitches in one call: one call per run of pages, as layer_first
needs, instead of one per page per layer.

Lifecycle: `Memcpy2D.load()` once per backend finds the function in the CUDA runtime that
torch has already loaded (its path read from /proc/self/maps), or returns None where there is
none to find (a statically linked runtime); the caller then copies one row per call. Calls
are enqueued on the stream given, like every other copy of the walk.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator

import torch

from hicache.errors import TransferError

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the pointers (UVA)
_RUNTIME_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12")


def _runtime_candidates() -> Iterator[str]:
    """Paths of the CUDA runtime this process has mapped, then the usual sonames."""
    seen: set[str] = set()
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "libcudart.so" in path and path not in seen:
                    seen.add(path)
                    yield path
    except OSError:
        pass
    yield from _RUNTIME_NAMES


class Memcpy2D:
    def __init__(self, function: Callable[..., int]):
        self._function = function

    @classmethod
    def load(cls) -> Memcpy2D | None:
        for candidate in _runtime_candidates():
            try:
                library = ctypes.CDLL(candidate)
                function = library.cudaMemcpy2DAsync
            except (OSError, AttributeError):
                continue
            function.argtypes = [
                ctypes.c_void_p,  # dst
                ctypes.c_size_t,  # dst pitch
                ctypes.c_void_p,  # src
                ctypes.c_size_t,  # src pitch
                ctypes.c_size_t,  # width in bytes
                ctypes.c_size_t,  # height in rows
                ctypes.c_int,  # kind
                ctypes.c_void_p,  # stream
            ]
            function.restype = ctypes.c_int
            return cls(function)
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """dst[:] = src for two `[rows, width]` uint8 views, each row contiguous in both."""
        height, width = src.shape
        if tuple(dst.shape) != (height, width) or src.stride(1) != 1 or dst.stride(1) != 1:
            raise TransferError(
                f"a 2-D copy needs two [rows, width] views of contiguous rows; got "
                f"{tuple(src.shape)} stride {src.stride()} -> {tuple(dst.shape)} "
                f"stride {dst.stride()}"
            )
        if height == 0:
            return
        status = self._function(
            dst.data_ptr(),
            dst.stride(0) if height > 1 else width,
            src.data_ptr(),
            src.stride(0) if height > 1 else width,
            width,
            height,
            _MEMCPY_DEFAULT,
            stream.cuda_stream,
        )
        if status != 0:
            raise TransferError(
                f"cudaMemcpy2DAsync of {height} rows of {width} bytes failed with CUDA error "
                f"{status}"
            )
