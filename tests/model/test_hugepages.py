"""Huge-page advice for the large buffers: best effort, and never wrong about the contents."""

from pathlib import Path

import torch

from shm_engine.model.hugepages import advise_huge_pages, empty_huge

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
