"""Transparent huge pages for large, long-lived buffers (the KV cache).

Why: decode attention reads each sequence's cache blocks from wherever they lie in a cache of
hundreds of MB, a TLB miss per 2 KB slab with 4 KB pages; with 2 MB pages batch-16 decode
attention took 1-13 % less time in two runs of three alternated pairs (benchmarks/RESULTS.md).
The machine's THP mode is usually ``madvise``, so a buffer must ask, ``madvise(MADV_HUGEPAGE)``,
before its pages are first touched. Best effort: anything that fails leaves 4 KB pages.
"""

from __future__ import annotations

import ctypes

import torch

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14

try:
    # NOTE: the process's own symbols (libc's among them); ctypes.util.find_library("c") would
    # run `ldconfig -p` in a subprocess at every engine start.
    _LIBC = ctypes.CDLL(None, use_errno=True)
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


class HugeArena:
    """One huge-page buffer handed out in 64-byte-aligned pieces: for the packed weights.

    Why: each layer's matrices are a few hundred KB to 2 MB, too small to get huge pages of
    their own. Batch-1 decode streams all of them (~135 MB for SmolLM2) every step; on 4 KB
    pages every 4 KB of weights costs a TLB miss, and a two-thread read stream ran at 24 GB/s
    there against 29 GB/s from huge pages (benchmarks/RESULTS.md). Pieces are views: the
    arena's memory lives as long as any of them.
    """

    _ALIGN = 64

    def __init__(self, nbytes: int) -> None:
        self._buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.huge = advise_huge_pages(self._buf)
        self._used = 0

    @staticmethod
    def footprint(numel: int, dtype: torch.dtype) -> int:
        """Bytes a piece of ``numel`` elements takes, alignment included."""
        size = numel * dtype.itemsize
        return -(-size // HugeArena._ALIGN) * HugeArena._ALIGN

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next ``numel`` elements of ``dtype``, uninitialised."""
        size = self.footprint(numel, dtype)
        if self._used + size > self._buf.numel():
            raise MemoryError(f"arena of {self._buf.numel()} bytes cannot fit {size} more")
        piece = self._buf[self._used : self._used + size].view(dtype)[:numel]
        self._used += size
        return piece
