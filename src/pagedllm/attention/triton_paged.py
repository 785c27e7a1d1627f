"""Paged attention in Triton, for the GPU backend (issue 32): one kernel for decode tokens,
prefill chunks and mixed batches, over the same block tables, prefix sharing, sliding
windows and soft caps as the CPU kernels.

Each query token is one program per query head: it walks its sequence's blocks through the
block table up to its own position (so a prefill chunk is causal, a decode token sees the
whole context, and a verifying request's positions each see their prefix), one KV block at a
time, with the online softmax, in float32 whatever the cache dtype. Grouped-query heads
read their KV head (head // group). That is the plainest correct layout, not the fastest on
a GPU (no tiling of queries): FlashInfer's kernels are the faster path where installed.

On a machine without a GPU the same kernel runs under Triton's interpreter
(`TRITON_INTERPRET=1`, CPU tensors; set before this module is imported), which is how CI
checks it against the torch reference (tests/test_triton_attention.py). Triton is imported
here only: nothing else in pagedllm needs it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.metadata import AttentionMetadata


@triton.jit
def _tanh(x):
    """tanh without cancellation: its series below |x| = 0.25 (error < 1e-9 there), else
    (1 - e) / (1 + e) with e = exp(-2|x|). The sigmoid form 2 sigmoid(2x) - 1 lost ~1e-4 of
    small values to the GPU's fast exp, which a soft cap of 50 turned into logits 6e-3 off."""
    ax = tl.abs(x)
    x2 = x * x
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0
                                                                     + x2 * (62.0 / 2835.0)))))
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    t = tl.where(ax < 0.25, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def _paged_attention(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_of_token_ptr, ctx_len_ptr,
                     scale, softcap, window,
                     stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh, stride_tb, stride_ot, stride_oh,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, BLOCK_P2: tl.constexpr,
                     USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
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
    offsets = tl.arange(0, BLOCK_P2)
    m_i = tl.full([1], -float("inf"), tl.float32)
    l_i = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([DIM_P2], dtype=tl.float32)
    for start in range(first // BLOCK_SIZE * BLOCK_SIZE, ctx, BLOCK_SIZE):
        block = tl.load(tables_ptr + seq * stride_tb + start // BLOCK_SIZE)
        positions = start + offsets
        visible = (offsets < BLOCK_SIZE) & (positions < ctx) & (positions >= first)
        rows = offsets[:, None]
        k = tl.load(k_ptr + block * stride_kb + rows * stride_ks + kv_head * stride_kh + dims[None, :],
                    mask=visible[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        if USE_SOFTCAP:  # cap * tanh(s / cap)
            scores = softcap * _tanh(scores / softcap)
        scores = tl.where(visible, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + block * stride_vb + rows * stride_vs + kv_head * stride_vh + dims[None, :],
                    mask=visible[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


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
    tables = meta.block_tables
    if tables is None:
        width = max(len(ids) for ids in meta.context_block_ids)
        tables = torch.zeros(meta.num_seqs, max(width, 1), dtype=torch.int64, device=device)
        for i, ids in enumerate(meta.context_block_ids):
            tables[i, :len(ids)] = ids
    both = torch.tensor([seq_of_token, ctx_len], dtype=torch.int64).to(device, non_blocking=True)
    meta.token_layout = (both[0], both[1], tables.to(device))
    return meta.token_layout


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, softcap: float | None = None,
                    window: int | None = None) -> torch.Tensor:
    """query [T, heads, D]; caches [blocks, block_size, kv_heads, D] already holding this
    step's keys and values; returns [T, heads, D] in the query's dtype. window: a token sees
    its last `window` positions (itself included); softcap: scores -> cap * tanh(s / cap)."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    seq_of_token, ctx_len, tables = token_layout(meta, query.device)
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    _paged_attention[(num_tokens, num_heads)](
        query, key_cache, value_cache, out, tables, seq_of_token, ctx_len,
        scale, softcap or 1.0, window or 0,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        DIM_P2=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_P2=triton.next_power_of_2(block_size),
        USE_SOFTCAP=softcap is not None, USE_WINDOW=window is not None)
    return out
