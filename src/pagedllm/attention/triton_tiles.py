"""The Triton paged attention kernel (triton_paged.py launches it): one program takes a tile of
query rows that share a KV head, the rows being TILE_TOKENS consecutive query tokens of one
sequence times the GROUP query heads of that KV head, and walks their context in KV tiles of
KV_TILE positions with the online softmax (FlashAttention-2's loop over a paged cache, as
vLLM's Triton attention does):

- Grouped-query heads share their KV head's reads: a KV tile is read once for the GROUP
  heads (and the tile's tokens), not once a head.
- A KV tile spans several cache blocks: each position finds its block in the table, so the
  tile's size is the kernel's choice, not the cache's block size (16 positions a block
  would make products too small to use the tensor cores).
- Both products are matrix products (tensor cores on a GPU): the scores in the model's
  dtype with float32 sums; the probabilities rounded to the values' dtype for the second
  (FlashAttention-2's choice). A float32 model multiplies in IEEE float32.

A decode step (every query a single token) takes one token a tile (its GROUP rows, padded to
the products' least 16) and may read long contexts in SPLITS parallel parts, merged by
_merge_splits (flash-decoding). Rows past the tile's tokens or the group are masked."""
from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.attention.triton_softcap import tanh


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with float32 sums. UPCAST: the operands as float32 (exact for half-precision
    values): Triton's interpreter multiplies bfloat16 operands' bits, not their values."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


# The steps' changing arguments (the tiles' count, the tables' width) are not specialised
# on: Triton would compile a variant for 1, multiples of 16 and the rest, and a step that
# met a new class would stall every request for a compile.
@triton.jit(do_not_specialize=["num_tiles", "stride_tb"])
def _paged_attention(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, tables_ptr, seq_of_token_ptr,
                     ctx_len_ptr, tiles_ptr, part_ml_ptr, part_acc_ptr, num_tiles,
                     scale, softcap, window,
                     stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_tb,
                     stride_ot, stride_oh,
                     NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                     TILE_TOKENS: tl.constexpr, ROWS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, KV_TILE: tl.constexpr,
                     USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
                     QUANTIZED: tl.constexpr, SPLITS: tl.constexpr,
                     IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Program (tile, KV head, split). TILE_TOKENS == 1 (a decode step): tile t is query
    token t, of sequence seq_of_token[t]; else tiles_ptr holds [3, num_tiles] (sequence,
    first token row, tokens). Row r of the tile is token r // GROUP_P2, head r % GROUP_P2
    of the group; each row sees first <= position < its ctx (causal; a window's first).
    QUANTIZED: int8 codes, each (slot, KV head) row with a float32 scale (ks_ptr, vs_ptr:
    [blocks, block_size, kv_heads], the KV head's stride 1). SPLITS > 1: the split's share
    of the positions (whole KV tiles; the last shares may be empty) into the partials."""
    tile = tl.program_id(0)  # tiles first: a step may hold more than a grid's 65535 rows
    kv_head = tl.program_id(1)
    if TILE_TOKENS == 1:
        seq = tl.load(seq_of_token_ptr + tile)
        start = tile
        count = 1
    else:
        seq = tl.load(tiles_ptr + tile)
        start = tl.load(tiles_ptr + num_tiles + tile)
        count = tl.load(tiles_ptr + 2 * num_tiles + tile)
    rows = tl.arange(0, ROWS)
    in_group = rows % GROUP_P2
    row_ok = (rows // GROUP_P2 < count) & (in_group < GROUP)
    token = start + rows // GROUP_P2
    head = kv_head * GROUP + in_group
    ctx = tl.load(ctx_len_ptr + token, mask=row_ok, other=0)
    first = ctx * 0
    if USE_WINDOW:
        first = tl.maximum(ctx - window, 0)
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    lo = tl.min(tl.where(row_ok, first, 1 << 30), axis=0)
    hi = tl.max(ctx, axis=0)
    if SPLITS > 1:
        share = (hi - lo + SPLITS * KV_TILE - 1) // (SPLITS * KV_TILE) * KV_TILE
        lo = lo + tl.program_id(2) * share
        hi = tl.minimum(lo + share, hi)
    offsets = tl.arange(0, KV_TILE)
    m_i = tl.full([ROWS], -float("inf"), tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, DIM_P2], dtype=tl.float32)
    for tile_start in range(lo, hi, KV_TILE):
        positions = tile_start + offsets
        # Slots past the tile's last position were never written (a fresh pool holds any
        # bits, NaN too, and a probability of 0 times NaN is NaN): never read.
        written = positions < hi
        block = tl.load(tables_ptr + seq * stride_tb + positions // BLOCK_SIZE, mask=written,
                        other=0)
        slot = positions % BLOCK_SIZE
        kv_ok = written[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks
                    + kv_head * stride_kh + dims[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                    + kv_head * stride_vh + dims[None, :], mask=kv_ok, other=0.0)
        if not QUANTIZED:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        else:
            row_scales = block * stride_sb + slot * stride_ss + kv_head
            k = (k.to(tl.float32) * tl.load(ks_ptr + row_scales, mask=written, other=0.0)[:, None]
                 ).to(q.dtype)
            v = (v.to(tl.float32) * tl.load(vs_ptr + row_scales, mask=written, other=0.0)[:, None]
                 ).to(q.dtype)
        scores = _dot(q, tl.trans(k), IEEE, UPCAST) * scale
        if USE_SOFTCAP:  # cap * tanh(s / cap)
            scores = softcap * tanh(scores / softcap)
        visible = (row_ok[:, None] & written[None, :] & (positions[None, :] < ctx[:, None])
                   & (positions[None, :] >= first[:, None]))
        scores = tl.where(visible, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row that has seen nothing yet (a window starting past this tile) stays empty.
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
        m_i = m_new
    store_ok = row_ok[:, None] & dim_ok[None, :]
    if SPLITS > 1:
        part = (token * NUM_HEADS + head) * SPLITS + tl.program_id(2)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * DIM_P2 + dims[None, :], acc, mask=store_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_ok)


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
