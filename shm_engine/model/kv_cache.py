"""The paged KV cache tensors: layout and allocation, shared by the int8 and fp32 models.

Layout per layer: k and v each [num_blocks, block_size, num_kv_heads, head_dim] fp32, as views of
one tensor for the whole model. NOTE: one allocation, not 2 x num_layers small ones: glibc serves
a single large request with its own mmap and unmaps it on free, so releasing the cache (engine
sleep) really returns the memory to the OS; many mid-size frees would stay in the malloc heap.
"""

from __future__ import annotations

import torch

from shm_engine.model.config import ModelConfig

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def kv_bytes_per_block(config: ModelConfig, block_size: int) -> int:
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * 4


def allocate_kv(config: ModelConfig, num_blocks: int, block_size: int) -> KVCaches:
    c = config
    whole = torch.zeros(c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
    return [(whole[i, 0], whole[i, 1]) for i in range(c.num_layers)]
