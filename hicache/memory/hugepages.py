"""Ask the kernel for transparent huge pages on a large host buffer before its first touch.

With THP in `madvise` mode (common), a plain allocation gets 4 KiB pages, and a random page
copy of small rows then pays a TLB miss per row. `advise_hugepages` is best effort: it
returns False where the platform or kernel does not take the advice, and changes nothing else.
"""

from __future__ import annotations

import ctypes
import sys

import torch

_MADV_HUGEPAGE = 14
_PAGE = 4096
_HUGE = 2 * 2**20


def advise_hugepages(buffer: torch.Tensor) -> bool:
    if not sys.platform.startswith("linux") or buffer.device.type != "cpu":
        return False
    nbytes = buffer.numel() * buffer.element_size()
    if nbytes < _HUGE:
        return False
    start = (buffer.data_ptr() + _PAGE - 1) // _PAGE * _PAGE
    end = (buffer.data_ptr() + nbytes) // _PAGE * _PAGE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        result = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        return False
    return bool(result == 0)
