"""Decode steps as CUDA graphs (`--cuda-graphs`, with `--device cuda`), as vLLM does: the
model's forward over a batch of single-token rows is captured once per batch size in
GRAPH_SIZES and replayed, so a step costs one graph launch instead of hundreds of kernel
launches from Python. A step of B rows runs the smallest captured size >= B; the extra rows
are padding that writes its K/V to a scratch block outside the pool and reads only it.

Everything a replay reads lives in static device buffers, filled before each replay: token
ids, positions, KV slots, and the Triton attention's per-token layout (its sequence row,
context length, block table), which the attention takes ready-made from the metadata
(`AttentionMetadata.token_layout`) instead of building it from host lists. Only steps
whose every query is a single token replay: decode tokens, and the positions of requests
verifying proposals (each position its own query, reading its table up to itself); a step
with a prefill chunk replays a graph of its own (mixed_graphs.py). Where the model keeps its sliding-window layers in a pool
of their own (Gemma 2 and 3), their slots and tables have static buffers too, and a scratch
block there. A mixture of experts is captured only for the sizes whose (token, expert)
pairs run on the device (LlamaForCausalLM.max_graph_batch). On the CPU (the generic path in
tests) the same buffers are filled and the same forward runs over them, uncaptured: only
capture and replay themselves need a GPU (scripts/gpu_check.sh).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention import AttentionMetadata

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class DecodeRow:
    """One request's single decode token: its id, position, KV slot and block table (and
    where the model keeps its sliding-window layers apart, their slot and table)."""

    token_id: int
    position: int
    slot: int
    block_table: tuple[int, ...]
    window_slot: int | None = None
    window_table: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PaddedDecode:
    """The static buffers' contents for a replay of `size` rows."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    ctx_lens: list[int]
    window_slots: list[int] | None
    # Each as wide as the widest row's table (the static buffer's columns past it keep
    # stale ids that no row reads: a row reads its table only up to its context).
    tables: list[list[int]]
    window_tables: list[list[int]] | None


def graph_size(batch: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `batch` rows, or None (run eagerly)."""
    return next((size for size in sizes if size >= batch), None)


def capture_sizes(sizes: tuple[int, ...], forward, device: torch.device, pool=None
                  ) -> tuple[dict, object]:
    """{size: (graph, its output)} for forward(size) captured at every size, largest first
    (the memory pool is then shared by the smaller ones, and by later captures given it),
    and the pool. Off a GPU (the generic path on the CPU, in tests) nothing is captured:
    each size maps to (None, None), and run() does the same forward eagerly."""
    if device.type != "cuda":
        return {size: (None, None) for size in sizes}, pool
    graphs = {}
    for size in reversed(sizes):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: compiles the kernels outside the capture
                forward(size)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward(size)
        if pool is None:
            pool = graph.pool()
        graphs[size] = (graph, out)
    torch.cuda.synchronize()
    return graphs, pool


def pad_decode(rows: list[DecodeRow], size: int, width: int, block_size: int,
               scratch_block: int, window_scratch_block: int | None = None) -> PaddedDecode:
    """Rows, then padding up to `size`: padding writes its K/V into the scratch block's first
    slot and attends to that one position only, so real rows and the pool are untouched.
    width: the static buffer's (no table may be wider); the tables are padded only to the
    widest of these rows (a step's copy then grows with the contexts, not the longest one
    the server allows)."""
    if len(rows) > size:
        raise ValueError(f"{len(rows)} rows do not fit a graph of {size}")
    widest = max((max(len(row.block_table), len(row.window_table or ())) for row in rows),
                 default=1)
    if widest > width:
        raise ValueError(f"a block table of {widest} is wider than {width}")
    width = max(widest, 1)
    input_ids = [row.token_id for row in rows] + [0] * (size - len(rows))
    positions = [row.position for row in rows] + [0] * (size - len(rows))
    ctx_lens = [row.position + 1 for row in rows] + [1] * (size - len(rows))
    slots, tables = _padded(rows, size, width, block_size, scratch_block,
                            lambda row: (row.slot, row.block_table))
    window_slots = window_tables = None
    if window_scratch_block is not None:  # the window layers' own pool, its own scratch
        window_slots, window_tables = _padded(rows, size, width, block_size,
                                              window_scratch_block,
                                              lambda row: (row.window_slot, row.window_table))
    return PaddedDecode(input_ids, positions, slots, ctx_lens, window_slots, tables,
                        window_tables)


def _padded(rows: list[DecodeRow], size: int, width: int, block_size: int, scratch: int,
            slot_and_table) -> tuple[list[int], list[list[int]]]:
    """One pool's slots and tables: the rows', then padding rows on the scratch block."""
    slots, tables = [], []
    for row in rows:
        slot, table = slot_and_table(row)
        slots.append(slot)
        tables.append(list(table) + [scratch] * (width - len(table)))
    for _ in range(size - len(rows)):
        slots.append(scratch * block_size)
        tables.append([scratch] * width)
    return slots, tables


class GraphSet:
    """One model's forward captured per size over static buffers (DecodeGraphs here,
    mixed_graphs.MixedGraphs): the subclass makes the buffers (input_ids, positions, slots,
    tables; window_slots and window_tables or None), the sizes and the metadata a size's
    forward reads (its _meta_for)."""

    # (each set by the subclass's __init__; no shared class-level defaults)
    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    window_slots: torch.Tensor | None
    window_tables: torch.Tensor | None
    sizes: tuple[int, ...]
    graphs: dict

    def _meta_for(self, size: int, slots: torch.Tensor, tables: torch.Tensor
                  ) -> AttentionMetadata:
        raise NotImplementedError

    def _meta(self, size: int) -> AttentionMetadata:
        step = self._meta_for(size, self.slots, self.tables)
        if self.window_slots is not None:
            step.window = self._meta_for(size, self.window_slots, self.window_tables)
        return step

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches,
                          self._meta(size))

    def capture(self) -> None:
        self.graphs, self.pool = capture_sizes(self.sizes, self._forward, self.input_ids.device,
                                               self.pool)

    def _replay(self, size: int, copies: list, pending) -> torch.Tensor:
        """Fill each (buffer, values) from its first row, write pending (the step before's
        tokens at their indices, on the device) over the ids, and replay `size`'s graph
        (off a GPU: run its forward)."""
        for target, values in copies:
            target[:len(values)].copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)
        if pending is not None:
            self.input_ids[pending[0]] = pending[1]
        graph, out = self.graphs[size]
        if graph is None:
            return self._forward(size)
        graph.replay()
        return out


class DecodeGraphs(GraphSet):
    """The captured graphs of one model and KV cache (a GPU's), by batch size."""

    def __init__(self, model, kv_caches, max_batch: int, width: int, block_size: int,
                 scratch_block: int, device: str = "cuda", window_scratch_block: int | None = None):
        """window_scratch_block: where the model keeps its sliding-window layers in a pool of
        their own, that pool's scratch block (their slots and tables get buffers too)."""
        self.model, self.kv_caches = model, kv_caches
        self.width, self.block_size, self.scratch_block = width, block_size, scratch_block
        self.window_scratch_block = window_scratch_block
        self.sizes = tuple(s for s in GRAPH_SIZES if s <= max_batch) or (GRAPH_SIZES[0],)
        top = self.sizes[-1]
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(top, **long)
        self.positions = torch.zeros(top, **long)
        self.slots = torch.full((top,), scratch_block * block_size, **long)
        self.seq_of_token = torch.arange(top, **long)
        self.ctx_lens = torch.ones(top, **long)
        self.tables = torch.full((top, width), scratch_block, **long)
        self.window_slots = self.window_tables = None
        if window_scratch_block is not None:
            self.window_slots = torch.full((top,), window_scratch_block * block_size, **long)
            self.window_tables = torch.full((top, width), window_scratch_block, **long)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def _meta_for(self, size: int, slots: torch.Tensor, tables: torch.Tensor
                  ) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slots[:size], query_start_loc=list(range(size + 1)),
            seq_lens=[1] * size, block_size=self.block_size,
            device=str(self.input_ids.device), num_requests=size,
            token_layout=(self.seq_of_token[:size], self.ctx_lens[:size], tables[:size]))

    def applies(self, batch: int) -> bool:
        return graph_size(batch, self.sizes) is not None and bool(self.graphs)

    def run(self, rows: list[DecodeRow], pending=None) -> torch.Tensor:
        """The final hidden states [len(rows), H] of one decode step, replayed. pending:
        (rows' indices, their tokens on the device): inputs sampled by the step before,
        written over the copied ids without the host seeing them (overlapped steps)."""
        size = graph_size(len(rows), self.sizes)
        padded = pad_decode(rows, size, self.width, self.block_size, self.scratch_block,
                            self.window_scratch_block)
        used = len(padded.tables[0])
        copies = [(self.input_ids, padded.input_ids), (self.positions, padded.positions),
                  (self.slots, padded.slots), (self.ctx_lens, padded.ctx_lens),
                  (self.tables[:, :used], padded.tables)]
        if self.window_slots is not None:
            copies += [(self.window_slots, padded.window_slots),
                       (self.window_tables[:, :used], padded.window_tables)]
        return self._replay(size, copies, pending)[:len(rows)]
