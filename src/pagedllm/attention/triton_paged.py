"""Paged attention in Triton, for the GPU backend (issue 32): decode tokens, prefill chunks
and mixed batches, over the same block tables, prefix sharing, sliding windows and soft caps
as the CPU kernels, from caches in the model's dtype or int8 codes with a float32 scale a
row (dequantized as they are read). One kernel (triton_tiles.py), launched with tiles of
query rows that share a KV head:

- A decode step (every query a single token: decode tokens, a verifying request's
  positions): one token a tile, its group's heads the tile's rows. A step of few tokens
  with long contexts reads each context in splits, in parallel, and merges their partial
  softmaxes (flash-decoding, as vLLM's paged attention v2): decode at N=1 would otherwise
  run only `kv_heads` programs, each walking its whole context. The split is chosen from
  shapes alone, so a CUDA graph's is fixed.
- A step with prefill chunks: each sequence's query tokens cut into tiles of
  `tile_shape(...).tokens`, each KV tile read once for a tile's tokens and heads.

On a machine without a GPU the same kernels run under Triton's interpreter
(`TRITON_INTERPRET=1`, CPU tensors; set before this module is imported), which is how CI
checks them against the torch reference (tests/test_triton_attention.py). The GPU's other
Triton kernels: backends/triton_layer_ops.py, models/int4_triton.py, models/moe_triton.py.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton_tiles import _merge_splits, _paged_attention

# Flash-decoding: a step of at most SPLIT_MAX_TOKENS query tokens whose widest block table
# is longer than SPLIT_BLOCKS blocks reads each context in parallel splits and merges them:
# one program per (token, KV head) would walk a long context alone (decode at N=1 runs only
# `kv_heads` programs). Whether to split comes from the shapes (static in a CUDA graph,
# whose table width is the longest context served); a split step always has MAX_SPLITS,
# among which each token's own context is divided on the device, by its length (so a short
# context in a graph sized for long ones is read in parallel too). One count, not one by
# width: each count is a kernel variant, compiled when first met, which mid-serving stalls
# every request. Above SPLIT_MAX_TOKENS the step has programs enough, and the partials'
# traffic (written for every split) would cost more than it gains.
SPLIT_BLOCKS = 16
MAX_SPLITS = 16
SPLIT_MAX_TOKENS = 16

# The products' least side (tl.dot's): a decode tile's rows are padded up to it.
MIN_ROWS = 16


class TileShape(NamedTuple):
    """A program's share: `tokens` query tokens of one sequence times the group's heads
    (padded to a power of two) as `rows`, against KV tiles of `kv_tile` positions."""

    tokens: int
    rows: int
    kv_tile: int


def tile_shape(group: int, head_dim: int, dtype: torch.dtype, decode: bool) -> TileShape:
    """Half-precision operands for heads up to 128 wide take tiles of 64 (FlashAttention-2's
    sizes, within a smaller card's shared memory); float32 ones and wider heads 32. A
    group wider than the tile (multi-query attention) takes one token, all its heads."""
    group_p2 = triton.next_power_of_2(group)
    size = 32 if head_dim > 128 or dtype == torch.float32 else 64
    if decode:
        return TileShape(1, max(MIN_ROWS, group_p2), size)
    rows = max(size, group_p2)
    return TileShape(rows // group_p2, rows, size)


def token_layout(meta: AttentionMetadata, device: torch.device | str = "cpu"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query token: its sequence's row in the block tables and how many positions it
    sees; and the tables, padded, as one [sequences, max blocks] tensor. Made once a step
    (kept in the metadata that every layer reads) in one copy to the device."""
    if meta.token_layout is not None:
        return meta.token_layout
    seq_of_token, ctx_len = [], []
    for i in range(meta.num_seqs):
        num_queries, seq_len = meta.num_queries(i), meta.seq_lens[i]
        seq_of_token += [i] * num_queries
        ctx_len += range(seq_len - num_queries + 1, seq_len + 1)
    num_tokens = len(ctx_len)
    # Rows of an even length: the second row then starts 16-byte aligned whatever the step's
    # token count (Triton compiles a kernel variant per pointer alignment, and a step that
    # met the other one would stall every request for a compile).
    pad = [0] * (num_tokens % 2)
    both = torch.tensor([seq_of_token + pad, ctx_len + pad], dtype=torch.int64).to(
        device, non_blocking=True)
    meta.token_layout = (both[0, :num_tokens], both[1, :num_tokens],
                         meta.block_tables.to(device))
    return meta.token_layout


def prefill_tiles(meta: AttentionMetadata, tokens: int, device: torch.device | str = "cpu"
                  ) -> torch.Tensor | None:
    """[3, tiles] (sequence, first token row, tokens) of the step's query tiles: each
    sequence's queries cut into `tokens`; None where every sequence has one query (a decode
    step: a token a tile, with its splits). Made once a step (per tile size), one copy."""
    if meta.prefill_tiles is False:  # decided this step already: a decode step
        return None
    if meta.prefill_tiles is None:
        if all(meta.num_queries(i) == 1 for i in range(meta.num_seqs)):
            meta.prefill_tiles = False
            return None
        meta.prefill_tiles = {}
    if tokens not in meta.prefill_tiles:
        seqs, starts, counts = [], [], []
        for i in range(meta.num_seqs):
            first, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            for start in range(first, end, tokens):
                seqs.append(i)
                starts.append(start)
                counts.append(min(tokens, end - start))
        meta.prefill_tiles[tokens] = torch.tensor([seqs, starts, counts], dtype=torch.int64).to(
            device, non_blocking=True)
    return meta.prefill_tiles[tokens]


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, softcap: float | None = None,
                    window: int | None = None, split_blocks: int | None = None,
                    key_scales: torch.Tensor | None = None,
                    value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, heads, D]; caches [blocks, block_size, kv_heads, D] already holding this
    step's keys and values; returns [T, heads, D] in the query's dtype. window: a token sees
    its last `window` positions (itself included); softcap: scores -> cap * tanh(s / cap).
    split_blocks: the widest table that is read unsplit, in blocks (default SPLIT_BLOCKS;
    tests make it small). key_scales, value_scales: an int8 cache's row scales [blocks,
    block_size, kv_heads] (layer_cache.py)."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    seq_of_token, ctx_len, tables = token_layout(meta, query.device)
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    dim_p2 = max(MIN_ROWS, triton.next_power_of_2(head_dim))
    quantized = key_scales is not None
    if quantized and not (key_scales.is_contiguous() and value_scales.is_contiguous()
                          and key_scales.stride() == value_scales.stride()):
        raise ValueError("paged_attention: the int8 cache's scales must be contiguous, alike")
    # (unread where the cache is not int8)
    scales = (key_scales, value_scales) if quantized else (ctx_len, ctx_len)
    scale_strides = key_scales.stride()[:2] if quantized else (0, 0)
    group = num_heads // num_kv_heads
    shape = tile_shape(group, head_dim, query.dtype, decode=True)
    tiles = prefill_tiles(meta, tile_shape(group, head_dim, query.dtype, False).tokens,
                          query.device)
    if tiles is not None:  # a step with prefill chunks: tiles of a sequence's tokens
        shape = tile_shape(group, head_dim, query.dtype, decode=False)
        splits, num_tiles = 1, tiles.shape[1]
    else:
        splits, num_tiles = _splits(num_tokens, tables.shape[1], split_blocks), num_tokens
    parts = (num_tokens * num_heads * splits) if splits > 1 else 1
    part_ml = torch.empty(parts * 2, dtype=torch.float32, device=query.device)
    part_acc = torch.empty(parts * dim_p2, dtype=torch.float32, device=query.device)
    _paged_attention[(num_tiles, num_kv_heads, splits)](
        query, key_cache, value_cache, *scales, out, tables, seq_of_token, ctx_len,
        seq_of_token if tiles is None else tiles, part_ml, part_acc, num_tiles,
        scale, softcap or 1.0, window or 0,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        *scale_strides, tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=group, GROUP_P2=triton.next_power_of_2(group),
        TILE_TOKENS=shape.tokens, ROWS=shape.rows, HEAD_DIM=head_dim, DIM_P2=dim_p2,
        BLOCK_SIZE=block_size, KV_TILE=shape.kv_tile,
        USE_SOFTCAP=softcap is not None, USE_WINDOW=window is not None, QUANTIZED=quantized,
        SPLITS=splits, IEEE=query.dtype == torch.float32, UPCAST=query.device.type != "cuda")
    if splits > 1:
        _merge_splits[(num_heads, num_tokens)](part_ml, part_acc, out, out.stride(0),
                                               out.stride(1), HEAD_DIM=head_dim, DIM_P2=dim_p2,
                                               SPLITS=splits)
    return out


def _splits(num_tokens: int, width: int, split_blocks: int | None) -> int:
    """How many splits each token's context is read in: one where the step has tokens
    enough to fill the GPU by itself or the widest table is no longer than split_blocks;
    else MAX_SPLITS. Decided from shapes alone (the table's width, static in a CUDA graph),
    never from the contexts' values (the kernel divides each context among the splits)."""
    split_blocks = split_blocks or SPLIT_BLOCKS
    if num_tokens > SPLIT_MAX_TOKENS or width <= split_blocks:
        return 1
    return MAX_SPLITS
