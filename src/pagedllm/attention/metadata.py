"""Per-step attention metadata: built once per step by the model runner, read by every layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where a flat batch of tokens from many sequences reads and writes the paged KV cache.

    Tokens of sequence i are rows query_start_loc[i]:query_start_loc[i+1] of the batch; they
    are the last (query_start_loc[i+1] - query_start_loc[i]) of its seq_lens[i] tokens, so a
    prefill chunk and a single decode token are the same case.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset per token
    query_start_loc: list[int]  # [num_seqs + 1], host-side: no device syncs inside layers
    seq_lens: list[int]  # [num_seqs] context length of each sequence after this step
    block_tables: list[list[int]]  # [num_seqs][num_blocks_i] block ids in order
    block_size: int
    # Derived once per step so layers do no per-layer host work.
    context_block_ids: list[torch.Tensor] | None = None

    @classmethod
    def build(cls, slot_mapping: list[int], query_start_loc: list[int], seq_lens: list[int],
              block_tables: list[list[int]], block_size: int) -> AttentionMetadata:
        context_block_ids = [
            torch.tensor(table[: (seq_len + block_size - 1) // block_size], dtype=torch.long)
            for table, seq_len in zip(block_tables, seq_lens)
        ]
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
            query_start_loc=list(query_start_loc),
            seq_lens=list(seq_lens),
            block_tables=[list(t) for t in block_tables],
            block_size=block_size,
            context_block_ids=context_block_ids,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)
