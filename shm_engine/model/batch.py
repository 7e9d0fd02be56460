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
        logit_rows: list[int],
        scores: list[tuple[int, int] | None] | None = None,
    ) -> BatchInputs:
        """Flatten sequences given as (all token ids, start, num new tokens, block ids).

        Logits rows, in order: each sequence's last new token where ``logit_rows[b]`` is 1 (or
        True), every new token where it equals their number (a decode checking draft tokens);
        then, for ``scores[b] = (j0, j1)``, the positions j0 - 1 .. j1 - 2 of sequence b, whose
        logits score its tokens j0 .. j1 - 1 (prompt logprobs).

        NOTE: a sequence whose every token needs logits is laid out as that many one-token
        sequences over the same blocks, so each row's attention is computed as a decode step
        computes it: the AVX-512 kernels sum a prefill tile in another order than a decode,
        and a draft checked on other bits than the plain step's could flip a near tie.

        NOTE: plain Python lists, one numpy array each at the end: between model steps the
        interpreter runs on cold caches, where numpy's per-sequence calls cost ~0.3 ms a batch-16
        decode step (~0.05 ms this way)."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        qsl = [0]
        first_rows = []
        logits_indices = []
        max_blocks = max(len(b) for _, _, _, b in seqs)
        table: list[int] = []
        for (tokens, start, n, blocks), rows in zip(seqs, logit_rows, strict=True):
            end = start + n
            first_rows.append(qsl[-1])
            padded = blocks + [0] * (max_blocks - len(blocks))
            if n == 1 or rows == n:  # decode rows
                for p in range(start, end):
                    ids.append(tokens[p])
                    positions.append(p)
                    slots.append(blocks[p // block_size] * block_size + p % block_size)
                    table.extend(padded)
                    seq_lens.append(p + 1)
                    qsl.append(qsl[-1] + 1)
                    if rows:
                        logits_indices.append(qsl[-1] - 1)
                continue
            if rows not in (0, 1):
                raise ValueError(f"logit_rows must be 0, 1 or the new tokens ({n}), got {rows}")
            ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            slots.extend(blocks[p // block_size] * block_size + p % block_size
                         for p in range(start, end))  # fmt: skip
            table.extend(padded)
            seq_lens.append(end)
            qsl.append(qsl[-1] + n)
            if rows:
                logits_indices.append(qsl[-1] - 1)
        if scores:
            for (_, start, _, _), score, row0 in zip(seqs, scores, first_rows, strict=True):
                if score is not None:
                    first = row0 + score[0] - 1 - start
                    logits_indices.extend(range(first, first + score[1] - score[0]))
        return BatchInputs(
            input_ids=torch.from_numpy(np.array(ids, dtype=np.int64)),
            positions=torch.from_numpy(np.array(positions, dtype=np.int64)),
            slot_mapping=torch.from_numpy(np.array(slots, dtype=np.int64)),
            block_table=torch.from_numpy(
                np.array(table, dtype=np.int32).reshape(len(seq_lens), max_blocks)
            ),
            seq_lens=torch.from_numpy(np.array(seq_lens, dtype=np.int32)),
            query_start_loc=torch.from_numpy(np.array(qsl, dtype=np.int32)),
            logits_indices=torch.from_numpy(np.array(logits_indices, dtype=np.int64)),
        )
