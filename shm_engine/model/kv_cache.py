"""The paged KV cache tensors: layout and allocation, shared by the int8 and fp32 models.

Layout per layer: k and v each [num_blocks, num_kv_heads, block_size, head_dim], head-major inside
a block so that one (block, head) is a contiguous slab for the attention kernel to stream. The
element type is the model's ``kv_dtype``: float16 for the int8 model (half the bytes that batched
decode reads; fp32 math), float32 for the fp32 torch path.

NOTE: one allocation, not 2 x num_layers small ones: glibc serves a single large request with its
own mmap and unmaps it on free, so releasing the cache (engine sleep) really returns the memory to
the OS; many mid-size frees would stay in the malloc heap.
"""

from __future__ import annotations

import torch

from shm_engine.model.config import ModelConfig

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def kv_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype = torch.float32
) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


def allocate_kv(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32
) -> KVCaches:
    c = config
    whole = torch.zeros(
        c.num_layers, 2, num_blocks, c.num_kv_heads, block_size, c.head_dim, dtype=dtype
    )
    return [(whole[i, 0], whole[i, 1]) for i in range(c.num_layers)]
