"""Paged attention for a step with prefill chunks, in Triton (triton_paged.py dispatches to
it): each sequence's queries in tiles of TILE_QUERIES (half that for heads over 128 wide),
one program a tile a head, which reads each KV block once for the tile and multiplies it as
matrices (FlashAttention's loop over a paged cache; one program a token would read every
block once per token). Each row of a tile sees its own causal range (a window's too); the
products run in float32. Under Triton's interpreter on the CPU, as triton_paged.py says."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton_softcap import tanh

# A step with prefill chunks: each sequence's query tokens in tiles of TILE_QUERIES, each
# tile one program a head that reads a KV block once for all its tokens; half that for
# heads wider than 128 (the tile's float32 operands must fit a smaller card's shared memory).
TILE_QUERIES = 32


def tile_queries(head_dim: int) -> int:
    return TILE_QUERIES if head_dim <= 128 else TILE_QUERIES // 2


@triton.jit(do_not_specialize=["num_tiles", "stride_tb"])
def _paged_prefill(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, tables_ptr, ctx_len_ptr,
                   tiles_ptr, num_tiles, scale, softcap, window,
                   stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                   stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_tb,
                   stride_ot, stride_oh,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TILE: tl.constexpr,
                   USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
                   QUANTIZED: tl.constexpr, IEEE: tl.constexpr):
    """Program (tile, head): up to TILE consecutive query tokens of one sequence against
    each KV block of their context, as two matrix products a block (FlashAttention's
    loop over a paged cache): the block is read once for the tile instead of once a token.
    A row of the tile sees first <= position < its ctx (causal; a window's first). The
    products run in float32 (IEEE for a float32 model; else TF32, which holds bfloat16 and
    float16 values exactly)."""
    tile = tl.program_id(0)  # tiles first: a step may hold more than a grid's 65535 rows
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tiles_ptr + tile)
    start = tl.load(tiles_ptr + num_tiles + tile)  # the tile's first token row
    count = tl.load(tiles_ptr + 2 * num_tiles + tile)
    rows = tl.arange(0, TILE)
    row_ok = rows < count
    ctx = tl.load(ctx_len_ptr + start + rows, mask=row_ok, other=0)
    first = ctx * 0
    if USE_WINDOW:
        first = tl.maximum(ctx - window, 0)
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    lo = tl.min(tl.where(row_ok, first, 1 << 30), axis=0) // BLOCK_SIZE * BLOCK_SIZE
    hi = tl.max(ctx, axis=0)
    offsets = tl.arange(0, BLOCK_N)
    in_block = offsets < BLOCK_SIZE
    m_i = tl.full([TILE], -float("inf"), tl.float32)
    l_i = tl.zeros([TILE], dtype=tl.float32)
    acc = tl.zeros([TILE, DIM_P2], dtype=tl.float32)
    for block_start in range(lo, hi, BLOCK_SIZE):
        block = tl.load(tables_ptr + seq * stride_tb + block_start // BLOCK_SIZE)
        positions = block_start + offsets
        # Slots past the tile's last position were never written (a fresh pool holds any
        # bits, NaN too, and a probability of 0 times NaN is NaN): never read.
        written = in_block & (positions < hi)
        kv_ok = written[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + block * stride_kb + offsets[:, None] * stride_ks + kv_head * stride_kh
                    + dims[None, :], mask=kv_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + block * stride_vb + offsets[:, None] * stride_vs + kv_head * stride_vh
                    + dims[None, :], mask=kv_ok, other=0.0).to(tl.float32)
        if QUANTIZED:
            row_scales = block * stride_sb + offsets * stride_ss + kv_head
            k = k * tl.load(ks_ptr + row_scales, mask=written, other=0.0)[:, None]
            v = v * tl.load(vs_ptr + row_scales, mask=written, other=0.0)[:, None]
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k), input_precision="tf32") * scale
        if USE_SOFTCAP:
            scores = softcap * tanh(scores / softcap)
        visible = (row_ok[:, None] & written[None, :] & (positions[None, :] < ctx[:, None])
                   & (positions[None, :] >= first[:, None]))
        scores = tl.where(visible, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row that has seen nothing yet (a window starting past this block) stays empty.
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="tf32")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def prefill_tiles(meta: AttentionMetadata, device: torch.device | str = "cpu",
                  tile: int = TILE_QUERIES) -> torch.Tensor | None:
    """[3, tiles] (sequence, first token row, tokens) of the step's query tiles: each
    sequence's queries cut into `tile`; None where every sequence has one query (a decode
    step: the per-token kernel, with its splits). Made once a step (per tile size), one
    copy."""
    if meta.prefill_tiles is False:  # decided this step already: a decode step
        return None
    if meta.prefill_tiles is None:
        if all(meta.num_queries(i) == 1 for i in range(meta.num_seqs)):
            meta.prefill_tiles = False
            return None
        meta.prefill_tiles = {}
    if tile not in meta.prefill_tiles:
        seqs, starts, counts = [], [], []
        for i in range(meta.num_seqs):
            first, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            for start in range(first, end, tile):
                seqs.append(i)
                starts.append(start)
                counts.append(min(tile, end - start))
        meta.prefill_tiles[tile] = torch.tensor([seqs, starts, counts], dtype=torch.int64).to(
            device, non_blocking=True)
    return meta.prefill_tiles[tile]


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      out: torch.Tensor, tables: torch.Tensor, ctx_len: torch.Tensor,
                      tiles: torch.Tensor, scale: float, softcap: float | None,
                      window: int | None, scales: tuple, scale_strides: tuple) -> torch.Tensor:
    """The step's query tiles (prefill_tiles) into out [T, heads, D]: ctx_len, tables as
    triton_paged.token_layout makes them; scales, scale_strides: an int8 cache's row scales
    and their (block, slot) strides (unread where the cache is not int8)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    _paged_prefill[(tiles.shape[1], num_heads)](
        query, key_cache, value_cache, *scales, out, tables, ctx_len, tiles,
        tiles.shape[1], scale, softcap or 1.0, window or 0,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), value_cache.stride(0), value_cache.stride(1),
        value_cache.stride(2), *scale_strides, tables.stride(0), out.stride(0),
        out.stride(1), GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        DIM_P2=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_N=max(16, triton.next_power_of_2(block_size)), TILE=tile_queries(head_dim),
        USE_SOFTCAP=softcap is not None, USE_WINDOW=window is not None,
        QUANTIZED=key_cache.dtype == torch.int8, IEEE=query.dtype == torch.float32)
    return out
