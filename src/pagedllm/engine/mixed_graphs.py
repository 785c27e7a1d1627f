"""Steps with prefill chunks as CUDA graphs too (issue 46; with `--cuda-graphs`, beside the
decode steps' graphs in cuda_graphs.py): the model's forward over a step of up to T tokens
of up to `max_seqs` sequences, captured once per token count in MIXED_SIZES (vLLM's full
graphs per padded token count). A step of n tokens replays the smallest size >= n.

Everything the forward reads sits in static buffers: token ids, positions, KV slots, and
the Triton attention's layout (each token's sequence row and context length, the block
tables, and the query tiles: [3, size] (sequence, first token, tokens), as the attention's
prefill_tiles makes them). A graph's grid is fixed: `size` tiles, the step's own first and
then empty ones (no tokens: they read and write nothing). Padding tokens write their K/V to
the scratch block (cuda_graphs.py's) and belong to no tile: their rows of the attention's
output are never written, and every later op is row by row, so they touch no real row.
The tables buffer has a row for each of max_seqs sequences plus a scratch row. On the CPU
(the generic path in tests) the same buffers are filled and the same forward runs over them
uncaptured."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.engine.cuda_graphs import GraphSet, graph_size

# Small sizes too: a short prompt's step pads to 16, not 64 (each size costs a capture).
MIXED_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)


@dataclass(frozen=True)
class MixedStep:
    """A step's tokens and sequences as the model runner lays them out: sequence i's queries
    are tokens query_start_loc[i]:query_start_loc[i + 1], the last of its seq_lens[i]."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    tables: list
    window_slots: list[int] | None = None
    window_tables: list | None = None


def query_tiles(query_start_loc: list[int], tokens: int, size: int, scratch_row: int
                ) -> list[list[int]]:
    """[3, size]: each sequence's queries cut into tiles of `tokens` (sequence, first token,
    count), then empty tiles on the scratch row."""
    seqs, starts, counts = [], [], []
    for i in range(len(query_start_loc) - 1):
        for start in range(query_start_loc[i], query_start_loc[i + 1], tokens):
            seqs.append(i)
            starts.append(start)
            counts.append(min(tokens, query_start_loc[i + 1] - start))
    pad = size - len(seqs)
    return [seqs + [scratch_row] * pad, starts + [0] * pad, counts + [0] * pad]


class MixedGraphs(GraphSet):
    """The captured graphs of one model and KV cache for steps with prefill chunks."""

    def __init__(self, model, kv_caches, max_tokens: int, max_seqs: int, width: int,
                 block_size: int, scratch_block: int, tile_tokens: int, device: str = "cuda",
                 window_scratch_block: int | None = None, pool=None):
        self.model, self.kv_caches = model, kv_caches
        self.max_seqs, self.width, self.block_size = max_seqs, width, block_size
        self.scratch_block, self.tile_tokens = scratch_block, tile_tokens
        self.sizes = tuple(s for s in MIXED_SIZES if s <= max_tokens) or (MIXED_SIZES[0],)
        top = self.sizes[-1]
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(top, **long)
        self.positions = torch.zeros(top, **long)
        self.scratch_slot = scratch_block * block_size
        self.slots = torch.full((top,), self.scratch_slot, **long)
        self.seq_of_token = torch.full((top,), max_seqs, **long)
        self.ctx_lens = torch.ones(top, **long)
        # Row max_seqs: the scratch row (padding tokens' and empty tiles'), never written.
        self.tables = torch.full((max_seqs + 1, width), scratch_block, **long)
        self.tiles = {size: torch.zeros(3, size, **long) for size in self.sizes}
        self.window_slots = self.window_tables = None
        self.window_scratch_slot = None
        if window_scratch_block is not None:
            self.window_scratch_slot = window_scratch_block * block_size
            self.window_slots = torch.full((top,), self.window_scratch_slot, **long)
            self.window_tables = torch.full((max_seqs + 1, width), window_scratch_block, **long)
        self.graphs: dict = {}
        self.pool = pool

    def _meta_for(self, size: int, slots: torch.Tensor, tables: torch.Tensor
                  ) -> AttentionMetadata:
        # (query_start_loc, seq_lens: unread, the layout and tiles being given)
        return AttentionMetadata(
            slot_mapping=slots[:size], query_start_loc=[0, size], seq_lens=[size],
            block_size=self.block_size, device=str(self.input_ids.device),
            token_layout=(self.seq_of_token[:size], self.ctx_lens[:size], tables),
            prefill_tiles={self.tile_tokens: self.tiles[size]})

    def fits(self, step: MixedStep) -> bool:
        """Whether a graph holds the step: tokens, sequences and tables within the buffers."""
        return (bool(self.graphs) and graph_size(len(step.input_ids), self.sizes) is not None
                and len(step.seq_lens) <= self.max_seqs
                and all(len(t) <= self.width for t in step.tables)
                and all(len(t) <= self.width for t in step.window_tables or ()))

    def run(self, step: MixedStep, pending=None) -> torch.Tensor:
        """The hidden states [tokens, H] of the step, replayed. pending: (token indices, their
        tokens on the device), written over the copied ids (overlapped steps)."""
        n = len(step.input_ids)
        size = graph_size(n, self.sizes)
        pad = size - n
        seq_of_token, ctx_lens = [], []
        for i, seq_len in enumerate(step.seq_lens):
            queries = step.query_start_loc[i + 1] - step.query_start_loc[i]
            seq_of_token += [i] * queries
            ctx_lens += range(seq_len - queries + 1, seq_len + 1)
        copies = [(self.input_ids, step.input_ids + [0] * pad),
                  (self.positions, step.positions + [0] * pad),
                  (self.slots, step.slots + [self.scratch_slot] * pad),
                  (self.seq_of_token, seq_of_token + [self.max_seqs] * pad),
                  (self.ctx_lens, ctx_lens + [1] * pad),
                  (self.tiles[size], query_tiles(step.query_start_loc, self.tile_tokens, size,
                                                 self.max_seqs))]
        copies += self._table_copies(self.tables, step.tables, self.scratch_block)
        if self.window_slots is not None:
            copies.append((self.window_slots, step.window_slots + [self.window_scratch_slot] * pad))
            copies += self._table_copies(self.window_tables, step.window_tables,
                                         int(self.window_tables[-1, 0]))
        return self._replay(size, copies, pending)[:n]

    @staticmethod
    def _table_copies(buffer: torch.Tensor, tables: list, scratch: int) -> list:
        """The step's tables into the buffer's first rows, each padded with the scratch block
        to the widest (the columns past it keep stale ids that no token reads)."""
        widest = max(max(len(t) for t in tables), 1)
        return [(buffer[:, :widest], [list(t) + [scratch] * (widest - len(t)) for t in tables])]
