"""Huge-page advice for the large buffers: best effort, and never wrong about the contents."""

from pathlib import Path

import pytest
import torch

from shm_engine.model import kernels
from shm_engine.model.hugepages import HugeArena, advise_huge_pages, empty_huge

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_empty_huge_is_zeroed_memory_of_the_shape():
    t = empty_huge(3, 1 << 20, dtype=torch.float16)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float16
    assert not t.any()


def test_advice_is_taken_where_the_kernel_offers_huge_pages():
    t = torch.empty(8 << 20, dtype=torch.uint8)
    took = advise_huge_pages(t)
    if THP.exists() and "[never]" not in THP.read_text():
        assert took
    assert not advise_huge_pages(torch.empty(100, dtype=torch.uint8))  # no whole 2 MB page


def test_arena_pieces_are_aligned_disjoint_views_and_overflow_is_an_error():
    arena = HugeArena(4 << 20)
    a = arena.take(100, torch.int16)
    b = arena.take(3, torch.int8)
    c = arena.take(10, torch.float32)
    assert (a.shape, a.dtype, b.shape, c.dtype) == ((100,), torch.int16, (3,), torch.float32)
    assert all(t.data_ptr() % 64 == 0 for t in (a, b, c))
    assert b.data_ptr() - a.data_ptr() == HugeArena.footprint(100, torch.int16) == 256
    a.fill_(-1), b.fill_(7), c.fill_(2.5)
    assert (a == -1).all() and (b == 7).all() and (c == 2.5).all()
    with pytest.raises(MemoryError, match="cannot fit"):
        arena.take(4 << 20, torch.int8)


def test_a_weight_packed_into_the_arena_is_the_heap_one():
    w = torch.randn(40, 70)
    arena = HugeArena(kernels.PackedLinear.arena_bytes(40, 70))
    heap, placed = (
        kernels.PackedLinear.from_float(w),
        kernels.PackedLinear.from_float(w, arena=arena),
    )
    assert torch.equal(heap.packed, placed.packed) and torch.equal(heap.scales, placed.scales)
    x = torch.randn(3, 70)
    assert torch.equal(heap(x), placed(x))
