"""The flattened inputs of one model step over a paged KV cache (what the model sees of a batch).

Sequence b contributes ``query_start_loc[b+1] - query_start_loc[b]`` new tokens, which are the last
tokens of its ``seq_lens[b]`` tokens; their KV entries go to ``slot_mapping`` (block * block_size
+ offset). This one layout serves prefill, prefill after a cached prefix, chunked prefill and
decode, mixed in a single step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class BatchInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    block_table: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    logits_indices: torch.Tensor  # int64 [S]: rows of T whose logits are needed

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @staticmethod
    def build(
        seqs: list[tuple[list[int], int, int, list[int]]],
        block_size: int,
        sample_mask: list[bool],
    ) -> BatchInputs:
        """Flatten sequences given as (all token ids, start, num new tokens, block ids)."""
        num_tokens = sum(n for _, _, n, _ in seqs)
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slots = np.empty(num_tokens, dtype=np.int64)
        max_blocks = max(len(b) for _, _, _, b in seqs)
        block_table = np.zeros((len(seqs), max_blocks), dtype=np.int32)
        seq_lens = np.empty(len(seqs), dtype=np.int32)
        qsl = np.zeros(len(seqs) + 1, dtype=np.int32)
        logits_indices = []
        t = 0
        for b, (tokens, start, n, blocks) in enumerate(seqs):
            end = start + n
            input_ids[t : t + n] = tokens[start:end]
            pos = np.arange(start, end, dtype=np.int64)
            positions[t : t + n] = pos
            blk = np.asarray(blocks, dtype=np.int64)
            slots[t : t + n] = blk[pos // block_size] * block_size + pos % block_size
            block_table[b, : len(blocks)] = blocks
            seq_lens[b] = end
            t += n
            qsl[b + 1] = t
            if sample_mask[b]:
                logits_indices.append(t - 1)
        return BatchInputs(
            input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(slots),
            block_table=torch.from_numpy(block_table),
            seq_lens=torch.from_numpy(seq_lens),
            query_start_loc=torch.from_numpy(qsl),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        )
