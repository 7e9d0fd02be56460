"""Transparent huge pages for large, long-lived buffers (the KV cache).

Why: decode attention reads each sequence's cache blocks from wherever they lie in a cache of
hundreds of MB, a TLB miss per 2 KB slab with 4 KB pages; with 2 MB pages batch-16 decode
attention took 1-13 % less time in two runs of three alternated pairs (benchmarks/RESULTS.md).
The machine's THP mode is usually ``madvise``, so a buffer must ask, ``madvise(MADV_HUGEPAGE)``,
before its pages are first touched. Best effort: anything that fails leaves 4 KB pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14

try:
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
except (OSError, AttributeError):
    _LIBC = None


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages under the 2 MB-aligned part of ``t``'s memory (call before the first
    write; pages already touched stay small). True if the kernel took the advice."""
    if _LIBC is None:
        return False
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // _HUGE) * _HUGE, end // _HUGE * _HUGE
    return hi > lo and _LIBC.madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


def empty_huge(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeroed memory of the given shape, on huge pages where the kernel allows."""
    t = torch.empty(*shape, dtype=dtype)
    advise_huge_pages(t)
    return t.zero_()
