"""Per-step attention metadata: built once per step by the model runner, read by every layer."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np
import torch


@dataclass
class DecodeBatch:
    """The single-token sequences of a step, padded for one batched attention computation."""

    rows: list[int]  # their rows in the flat token batch
    rows_tensor: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with block 0
    padding_mask: torch.Tensor  # [S, 1, 1, max_blocks * block_size] True where padding
    seq_lens: torch.Tensor  # [S] int64


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
    block_size: int
    # The same tokens in the sliding-window layers' own blocks, where the model keeps them
    # apart (core/kv_cache/window.py); those layers read and write through it.
    window: AttentionMetadata | None = None
    # Requests in the step, where fewer than the sequences above: a request verifying
    # proposed tokens is one single-token sequence per position (engine/model_runner.py),
    # and kernels that choose their arithmetic by batch size choose by this (DecodeLoop).
    num_requests: int | None = None
    device: str = "cpu"  # where its tensors live: the KV cache's (the generic backend's)
    # Per query token its sequence's row and context length, and the padded block tables,
    # as device tensors made once (a CUDA graph's static buffers: engine/cuda_graphs.py);
    # None: the Triton attention builds them from the lists above.
    token_layout: tuple | None = None
    # The Triton attention's query tiles of a step with prefill chunks, by tile size
    # (triton_paged.py: prefill_tiles), made on first use; False: the step has none.
    prefill_tiles: dict | bool | None = None
    # [sequences, widest table] the block tables, each row the blocks covering seq_lens[i]
    # and then block 0: build() or from_tables() makes it (a CUDA graph's metadata has
    # token_layout instead).
    block_tables: torch.Tensor | None = None
    _prefill_masks: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, slot_mapping: list[int], query_start_loc: list[int], seq_lens: list[int],
              block_tables: list[Sequence[int]], block_size: int,
              device: str = "cpu") -> AttentionMetadata:
        """From each sequence's own table (lists or tuples of block ids)."""
        width = max(-(-max(seq_lens, default=0) // block_size), 1)
        padded = np.zeros((max(len(block_tables), 1), width), dtype=np.int64)
        for row, (table, seq_len) in enumerate(zip(block_tables, seq_lens)):
            n = -(-seq_len // block_size)
            padded[row, :n] = table[:n]
        return cls.from_tables(slot_mapping, query_start_loc, seq_lens, padded, block_size,
                               device)

    @classmethod
    def from_tables(cls, slot_mapping: list[int], query_start_loc: list[int],
                    seq_lens: list[int], block_tables: np.ndarray, block_size: int,
                    device: str = "cpu") -> AttentionMetadata:
        """From the step's tables already padded ([sequences, widest], block 0 past each
        row's blocks), as the model runner gathers them (engine/block_table_rows.py). They
        are copied to the device once a step; each sequence's blocks are a view of its row
        (a copy per sequence cost a transfer each, ~0.3 ms a request a step on a GPU)."""
        padded = torch.from_numpy(block_tables)
        slots = torch.tensor(slot_mapping, dtype=torch.long)
        if device != "cpu":
            padded = padded.to(device, non_blocking=True)
            slots = slots.to(device, non_blocking=True)
        return cls(slot_mapping=slots, query_start_loc=list(query_start_loc),
                   seq_lens=list(seq_lens), block_size=block_size, device=device,
                   block_tables=padded)

    def blocks_of(self, i: int) -> torch.Tensor:
        """Sequence i's blocks covering its seq_lens[i] tokens (a view of its table's row)."""
        return self.block_tables[i, :-(-self.seq_lens[i] // self.block_size)]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def num_queries(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    def prefill_seq_indices(self) -> list[int]:
        return [i for i in range(self.num_seqs) if self.num_queries(i) > 1]

    def prefill_mask(self, i: int) -> torch.Tensor | None:
        """Causal mask [queries, seq_len] for a chunk that continues a sequence (None when the
        chunk is the whole sequence: plain causal). Built once per step, shared by layers."""
        if self.num_queries(i) == self.seq_lens[i]:
            return None
        if i not in self._prefill_masks:
            seq_len, num_queries = self.seq_lens[i], self.num_queries(i)
            query_pos = torch.arange(seq_len - num_queries, seq_len,
                                     device=self.device).unsqueeze(1)
            self._prefill_masks[i] = (torch.arange(seq_len, device=self.device).unsqueeze(0)
                                      <= query_pos)
        return self._prefill_masks[i]

    def decode_batch(self) -> DecodeBatch | None:
        return self._decode_batch

    @cached_property
    def _decode_batch(self) -> DecodeBatch | None:
        # Computed on first use, i.e. once per step, then shared by every layer.
        seqs = [i for i in range(self.num_seqs) if self.num_queries(i) == 1]
        if not seqs:
            return None
        bs = self.block_size
        max_blocks = max(-(-self.seq_lens[i] // bs) for i in seqs)
        lens = torch.tensor([self.seq_lens[i] for i in seqs], device=self.device)
        # (padded with block 0 already)
        tables = self.block_tables[torch.tensor(seqs, device=self.device), :max_blocks]
        padding = (torch.arange(max_blocks * bs, device=self.device).unsqueeze(0)
                   >= lens.unsqueeze(1))
        rows = [self.query_start_loc[i] for i in seqs]
        return DecodeBatch(rows, torch.tensor(rows, device=self.device), tables,
                           padding.view(len(seqs), 1, 1, -1), lens)
