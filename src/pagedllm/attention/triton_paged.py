"""Paged attention in Triton, for the GPU backend (issue 32): decode tokens, prefill chunks
and mixed batches, over the same block tables, prefix sharing, sliding windows and soft caps
as the CPU kernels, from caches in the model's dtype or int8 codes with a float32 scale a
row (dequantized as they are read). Two kernels:

- A decode step (every query a single token: decode tokens, a verifying request's
  positions): one program a query head a token walks its sequence's blocks through the
  block table up to its own position, one KV block at a time, with the online softmax, in
  float32 whatever the cache dtype. Grouped-query heads read their KV head (head // group);
  the heads are the grid's first (fastest) axis, so the programs of a group run side by
  side and read its KV blocks through the cache once. A step of few tokens with long
  contexts reads each context in splits, in parallel, and merges their partial softmaxes
  (flash-decoding, as vLLM's paged attention v2): decode at N=1 would otherwise run only
  `heads` programs, each walking its whole context. The split is chosen from shapes alone,
  so a CUDA graph's is fixed.
- A step with prefill chunks: query tiles, each KV block read once for a tile of a
  sequence's tokens (triton_prefill.py).

On a machine without a GPU the same kernels run under Triton's interpreter
(`TRITON_INTERPRET=1`, CPU tensors; set before this module is imported), which is how CI
checks them against the torch reference (tests/test_triton_attention.py). The GPU's other
Triton kernels: backends/triton_layer_ops.py, models/int4_triton.py, models/moe_triton.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton_prefill import prefill_attention, prefill_tiles, tile_queries
from pagedllm.attention.triton_softcap import tanh

# Flash-decoding: a step of at most SPLIT_MAX_TOKENS query tokens whose widest block table
# is longer than SPLIT_BLOCKS blocks reads each context in parallel splits and merges them:
# one program per (token, head) would walk a long context alone (decode at N=1 runs only
# `heads` programs). Whether to split comes from the shapes (static in a CUDA graph, whose
# table width is the longest context served); a split step always has MAX_SPLITS, among
# which each token's own context is divided on the device, by its length (so a short
# context in a graph sized for long ones is read in parallel too). One count, not one by
# width: each count is a kernel variant, compiled when first met, which mid-serving stalls
# every request. Above SPLIT_MAX_TOKENS the step has programs enough, and the partials'
# traffic (written for every split) would cost more than it gains.
SPLIT_BLOCKS = 16
MAX_SPLITS = 16
SPLIT_MAX_TOKENS = 16
@triton.jit
def _attend(q, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, seq, kv_head, lo, hi, first, ctx,
            scale, softcap, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_sb, stride_ss, stride_tb,
            HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_P2: tl.constexpr, USE_SOFTCAP: tl.constexpr, QUANTIZED: tl.constexpr):
    """Online softmax over the positions [lo, hi) of the sequence that this query sees
    (first <= position < ctx), lo a multiple of BLOCK_SIZE: (running max, sum, weighted
    values), unnormalised. An empty range gives (-inf, 0, 0). QUANTIZED: the cache holds
    int8 codes, each (slot, KV head) row with its float32 scale (ks_ptr, vs_ptr: [blocks,
    block_size, kv_heads], the KV head's stride 1), dequantized as they are read."""
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    offsets = tl.arange(0, BLOCK_P2)
    m_i = tl.full([1], -float("inf"), tl.float32)
    l_i = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([DIM_P2], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_SIZE):
        block = tl.load(tables_ptr + seq * stride_tb + start // BLOCK_SIZE)
        positions = start + offsets
        visible = (offsets < BLOCK_SIZE) & (positions < ctx) & (positions >= first)
        rows = offsets[:, None]
        k = tl.load(k_ptr + block * stride_kb + rows * stride_ks + kv_head * stride_kh + dims[None, :],
                    mask=visible[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        if QUANTIZED:
            row_scales = block * stride_sb + offsets * stride_ss + kv_head
            k = k * tl.load(ks_ptr + row_scales, mask=visible, other=0.0)[:, None]
        scores = tl.sum(k * q[None, :], axis=1) * scale
        if USE_SOFTCAP:  # cap * tanh(s / cap)
            scores = softcap * tanh(scores / softcap)
        scores = tl.where(visible, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + block * stride_vb + rows * stride_vs + kv_head * stride_vh + dims[None, :],
                    mask=visible[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        if QUANTIZED:
            v = v * tl.load(vs_ptr + row_scales, mask=visible, other=0.0)[:, None]
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    return m_i, l_i, acc


# Arguments that change from step to step (the tables' width, the tiles' count) are not
# specialised on (Triton compiles a variant for 1, multiples of 16 and the rest): a step
# that met a new class would otherwise stall every request for a compile.
@triton.jit(do_not_specialize=["stride_tb"])
def _paged_attention(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, tables_ptr, seq_of_token_ptr,
                     ctx_len_ptr, part_ml_ptr, part_acc_ptr, scale, softcap, window,
                     stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_tb,
                     stride_ot, stride_oh,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, BLOCK_P2: tl.constexpr,
                     USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
                     QUANTIZED: tl.constexpr, SPLITS: tl.constexpr):
    """SPLITS == 1: the whole context, the output written. Else program (head, token, split)
    takes its share of the context's blocks (whole blocks, the token's blocks over SPLITS,
    rounded up; the last shares may be empty) and writes its partial (max, sum) and
    weighted values, which _merge_splits combines (flash-decoding: a long context's blocks
    read in parallel instead of by one program)."""
    head = tl.program_id(0)  # heads vary fastest: a group's programs read its KV together
    token = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(seq_of_token_ptr + token)
    ctx = tl.load(ctx_len_ptr + token)  # this token sees positions first .. ctx - 1
    first = ctx * 0
    if USE_WINDOW:
        first = tl.maximum(ctx - window, 0)
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + token * stride_qt + head * stride_qh + dims, mask=dim_ok, other=0.0)
    q = q.to(tl.float32)
    lo = first // BLOCK_SIZE * BLOCK_SIZE
    hi = ctx
    if SPLITS > 1:
        share = (ctx - lo + SPLITS * BLOCK_SIZE - 1) // (SPLITS * BLOCK_SIZE) * BLOCK_SIZE
        lo = lo + tl.program_id(2) * share
        hi = tl.minimum(lo + share, ctx)
    m_i, l_i, acc = _attend(q, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, seq, kv_head, lo, hi,
                            first, ctx, scale, softcap, stride_kb, stride_ks, stride_kh,
                            stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_tb,
                            HEAD_DIM, DIM_P2, BLOCK_SIZE, BLOCK_P2, USE_SOFTCAP, QUANTIZED)
    if SPLITS > 1:
        part = (token * tl.num_programs(0) + head) * SPLITS + tl.program_id(2)
        two = tl.arange(0, 2)
        tl.store(part_ml_ptr + part * 2 + two, tl.where(two == 0, tl.max(m_i, axis=0),
                                                         tl.sum(l_i, axis=0)))
        tl.store(part_acc_ptr + part * DIM_P2 + dims, acc)
    else:
        out = acc / l_i
        tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
                 out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@triton.jit
def _merge_splits(part_ml_ptr, part_acc_ptr, out_ptr, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, SPLITS: tl.constexpr):
    """One (head, token): its splits' partial softmaxes as one (empty splits weigh 0)."""
    head = tl.program_id(0)
    token = tl.program_id(1)
    base = (token * tl.num_programs(0) + head) * SPLITS
    splits = tl.arange(0, SPLITS)
    maxima = tl.load(part_ml_ptr + (base + splits) * 2)
    sums = tl.load(part_ml_ptr + (base + splits) * 2 + 1)
    top = tl.max(maxima, axis=0)  # the first split is never empty: finite
    weights = tl.where(maxima == -float("inf"), 0.0, tl.exp(maxima - top))
    dims = tl.arange(0, DIM_P2)
    values = tl.load(part_acc_ptr + (base + splits)[:, None] * DIM_P2 + dims[None, :])
    total = tl.sum(sums * weights, axis=0)
    out = tl.sum(values * weights[:, None], axis=0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


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
    dim_p2 = triton.next_power_of_2(head_dim)
    quantized = key_scales is not None
    if quantized and not (key_scales.is_contiguous() and value_scales.is_contiguous()
                          and key_scales.stride() == value_scales.stride()):
        raise ValueError("paged_attention: the int8 cache's scales must be contiguous, alike")
    # (unread where the cache is not int8)
    scales = (key_scales, value_scales) if quantized else (ctx_len, ctx_len)
    scale_strides = key_scales.stride()[:2] if quantized else (0, 0)
    tiles = prefill_tiles(meta, query.device, tile_queries(head_dim))
    if tiles is not None:  # a step with prefill chunks: query tiles, a block read once each
        return prefill_attention(query, key_cache, value_cache, out, tables, ctx_len, tiles,
                                 scale, softcap, window, scales, scale_strides)
    splits = _splits(num_tokens, tables.shape[1], split_blocks)
    parts = (num_tokens * num_heads * splits) if splits > 1 else 1
    part_ml = torch.empty(parts * 2, dtype=torch.float32, device=query.device)
    part_acc = torch.empty(parts * dim_p2, dtype=torch.float32, device=query.device)
    _paged_attention[(num_heads, num_tokens, splits)](
        query, key_cache, value_cache, *scales, out, tables, seq_of_token, ctx_len, part_ml,
        part_acc, scale, softcap or 1.0, window or 0,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        *scale_strides, tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, DIM_P2=dim_p2,
        BLOCK_SIZE=block_size, BLOCK_P2=triton.next_power_of_2(block_size),
        USE_SOFTCAP=softcap is not None, USE_WINDOW=window is not None, QUANTIZED=quantized,
        SPLITS=splits)
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
