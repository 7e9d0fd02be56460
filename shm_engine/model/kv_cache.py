"""The paged KV cache tensors: layout and allocation, shared by the int8 and fp32 models.

Layout per layer: k and v each [num_blocks, num_kv_heads, slab_rows, head_dim], head-major inside
a block so that one (block, head) is a contiguous slab for the attention kernel to stream. The
element type is the model's ``kv_dtype``: float16 for the int8 model by default (half the bytes
that batched decode reads; fp32 math), int8 on request (53 % of fp16's bytes: rows quantised
with a scale each, keys Hadamard-rotated first; see native/kernels/kv_quant.c), float32 for the
fp32 torch path. A slab has one row per position (``block_size``); an int8 slab then holds the positions'
fp32 scales in ``ceil(4 * block_size / head_dim)`` more rows.

NOTE: one allocation, not 2 x num_layers small ones: glibc serves a single large request with its
own mmap and unmaps it on free, so releasing the cache (engine sleep) really returns the memory to
the OS; many mid-size frees would stay in the malloc heap. It asks for transparent huge pages
(model/hugepages.py): attention reads blocks scattered over the whole allocation.
"""

from __future__ import annotations

import torch

from shm_engine.model.config import ModelConfig
from shm_engine.model.hugepages import empty_huge

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


# The cache element types by the names users give them (EngineConfig.kv_cache_dtype)
KV_CACHE_DTYPES = {"fp16": torch.float16, "int8": torch.int8}


def kv_slab_rows(block_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Rows of one (block, kv head) slab: a row per position, then for int8 their fp32 scales."""
    if dtype == torch.int8:
        return block_size + -(-4 * block_size // head_dim)
    return block_size


def kv_block_size(slab_rows: int, head_dim: int, dtype: torch.dtype) -> int:
    """The block size whose slabs have ``slab_rows`` rows (kv_slab_rows inverted)."""
    if dtype != torch.int8:
        return slab_rows
    guess = slab_rows * head_dim // (head_dim + 4)
    for bs in (guess - 1, guess, guess + 1, guess + 2):
        if bs >= 1 and kv_slab_rows(bs, head_dim, dtype) == slab_rows:
            return bs
    raise ValueError(f"{slab_rows} rows of {head_dim} is no int8 cache slab")


def check_kv_dtype(dtype: torch.dtype, head_dim: int) -> None:
    """int8 rows are Hadamard-rotated: head_dim must be a power of two, from 4 to 1024.

    NOTE: at least 4: a slab's fp32 scales start right after its block_size rows of head_dim
    bytes, 4-byte aligned only when head_dim is a multiple of 4 (with 1 or 2 the kernels read
    and wrote misaligned floats)."""
    if dtype == torch.int8 and (head_dim & (head_dim - 1) or not 4 <= head_dim <= 1024):
        raise ValueError(
            f"an int8 KV cache needs a power-of-two head_dim from 4 to 1024, got {head_dim}"
        )


def kv_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype = torch.float32
) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    rows = kv_slab_rows(block_size, config.head_dim, dtype)
    return 2 * config.num_layers * rows * config.num_kv_heads * config.head_dim * elem


def allocate_kv(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32
) -> KVCaches:
    c = config
    check_kv_dtype(dtype, c.head_dim)
    rows = kv_slab_rows(block_size, c.head_dim, dtype)
    whole = empty_huge(c.num_layers, 2, num_blocks, c.num_kv_heads, rows, c.head_dim, dtype=dtype)
    return [(whole[i, 0], whole[i, 1]) for i in range(c.num_layers)]
