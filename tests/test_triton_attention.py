"""The GPU backend's Triton paged attention (attention/triton_paged.py), run on CPU tensors
under Triton's interpreter, against a plain torch reference: decode tokens, prefill chunks
(from the start and continuing), mixed batches, shared prefix blocks, sliding windows, soft
caps, grouped-query heads, every head_dim the CPU kernels take, odd block sizes, int8
caches."""
from __future__ import annotations

# CI: CPU tensors under Triton's interpreter (gpu_path switches it on, before Triton is
# imported). On a GPU machine scripts/gpu_check.sh runs the same tests compiled, with
# PAGEDLLM_TEST_DEVICE=cuda.
from gpu_path import ON as DEVICE, skip_without_the_gpu

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedllm.attention import AttentionMetadata  # noqa: E402
from pagedllm.attention.layer_cache import quantize_rows  # noqa: E402
from pagedllm.attention.triton_paged import paged_attention, token_layout  # noqa: E402

skip_without_the_gpu()


def reference(query, key_cache, value_cache, meta, scale, softcap=None, window=None):
    """Per query token, softmax over the positions it sees, in float64."""
    out = torch.empty(query.shape, dtype=torch.float64)
    block_size = key_cache.shape[1]
    group = query.shape[1] // key_cache.shape[2]
    for i in range(meta.num_seqs):
        start, seq_len, nq = meta.query_start_loc[i], meta.seq_lens[i], meta.num_queries(i)
        blocks = meta.blocks_of(i)
        keys = key_cache[blocks].flatten(0, 1)[:seq_len].double()
        values = value_cache[blocks].flatten(0, 1)[:seq_len].double()
        for j in range(nq):
            pos = seq_len - nq + j
            first = 0 if window is None else max(0, pos + 1 - window)
            for h in range(query.shape[1]):
                k, v = keys[first:pos + 1, h // group], values[first:pos + 1, h // group]
                s = (k @ query[start + j, h].double()) * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                out[start + j, h] = s.softmax(0) @ v
    assert block_size > 0
    return out


def scattered_tables(lengths, block_size, num_blocks, seed, shared_prefix_blocks=0):
    """Non-overlapping random blocks per sequence; the first `shared_prefix_blocks` of every
    table the same blocks (a shared system prompt)."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    shared = [order.pop() for _ in range(shared_prefix_blocks)]
    tables = []
    for n in lengths:
        need = -(-n // block_size)
        tables.append(shared[:need] + [order.pop() for _ in range(need - len(shared[:need]))])
    return tables


def run_case(chunks, heads, kv_heads, head_dim, block_size=16, dtype=torch.float32,
             softcap=None, window=None, shared_prefix_blocks=0, seed=0, split_blocks=None,
             int8=False):
    """chunks: (tokens already cached, tokens computed this step) per sequence. int8: the
    caches as int8 codes with row scales (layer_cache.py), the reference reading them
    dequantized."""
    torch.manual_seed(seed)
    lengths = [done + new for done, new in chunks]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 8
    tables = scattered_tables(lengths, block_size, num_blocks, seed, shared_prefix_blocks)
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    starts = [0]
    slots = []
    for (done, new), table in zip(chunks, tables):
        starts.append(starts[-1] + new)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(done, done + new)]
    meta = AttentionMetadata.build(slots, starts, lengths, tables, block_size)
    query = torch.randn(starts[-1], heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    # Slots no sequence wrote hold NaN (a fresh pool holds any bits): never to be read.
    unwritten = torch.ones(num_blocks * block_size, dtype=torch.bool)
    for n, table in zip(lengths, tables):
        unwritten[[table[p // block_size] * block_size + p % block_size for p in range(n)]] = False
    unwritten = unwritten.view(num_blocks, block_size)
    scales = {}
    if int8:
        (key_cache, key_scales), (value_cache, value_scales) = map(
            quantize_rows, (key_cache, value_cache))
        key_scales[unwritten] = value_scales[unwritten] = float("nan")
        scales = dict(key_scales=key_scales.to(DEVICE), value_scales=value_scales.to(DEVICE))
    else:
        key_cache[unwritten] = value_cache[unwritten] = float("nan")
    got = paged_attention(query.to(DEVICE), key_cache.to(DEVICE), value_cache.to(DEVICE), meta,
                          scale, softcap, window, split_blocks=split_blocks, **scales).cpu()
    if int8:
        key_cache = key_cache.float() * key_scales.unsqueeze(-1)
        value_cache = value_cache.float() * value_scales.unsqueeze(-1)
    want = reference(query.float(), key_cache.float(), value_cache.float(), meta, scale, softcap, window)
    assert got.dtype == dtype and got.shape == query.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.double() - want).abs().max() < tolerance


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 64), (6, 3, 128),
                                                    (4, 1, 96), (2, 2, 256), (4, 2, 80)])
def test_decode_tokens(heads, kv_heads, head_dim):
    run_case([(0, 1), (16, 1), (40, 1), (5, 1)], heads, kv_heads, head_dim)


@pytest.mark.parametrize("done,new,block_size", [(0, 23, 16), (17, 9, 16), (30, 33, 8), (3, 11, 5)])
def test_prefill_chunks_from_the_start_and_continuing(done, new, block_size):
    run_case([(done, new)], 4, 2, 64, block_size=block_size)


@pytest.mark.parametrize("heads,kv_heads,dtype", [(6, 2, torch.float32), (6, 2, torch.bfloat16),
                                                 (32, 1, torch.bfloat16), (4, 4, torch.bfloat16)])
def test_groups_of_every_width_share_a_tile(heads, kv_heads, dtype):
    """A group of 3 (padded to 4 rows a token), a multi-query group of 32 (one token a tile),
    one head a group: prefill chunks beside decode tokens, and a decode step alone."""
    run_case([(0, 40), (9, 1), (20, 13)], heads, kv_heads, 64, dtype=dtype, seed=heads)
    run_case([(0, 1), (30, 1), (70, 1)], heads, kv_heads, 64, dtype=dtype, seed=heads)


def test_a_mixed_batch_and_a_verifying_request_layout():
    # Prefill chunks, decode tokens, and one request's positions as single-token queries
    # (how a request verifies proposals: engine/model_runner.py) in one step.
    chunks = [(0, 12), (20, 1), (7, 6), (33, 1), (33, 1)]
    run_case(chunks, 8, 4, 64, seed=3)


def test_shared_prefix_blocks_are_read_by_every_sequence():
    run_case([(32, 1), (32, 5), (40, 1)], 4, 2, 64, shared_prefix_blocks=2, seed=5)


@pytest.mark.parametrize("window", [1, 5, 16, 20])
def test_sliding_window(window):
    run_case([(0, 30), (37, 1), (12, 8)], 4, 2, 64, window=window, seed=window)


def test_soft_cap_and_window_together():
    run_case([(0, 19), (25, 1)], 4, 2, 128, softcap=2.0, window=9, seed=7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(dtype):
    run_case([(0, 17), (21, 1)], 8, 2, 64, dtype=dtype, seed=11)


@pytest.mark.parametrize("split_blocks", [None, 1])
def test_an_int8_cache_read_through_its_row_scales(split_blocks):
    """Decode tokens, a prefill chunk and a mixed step over int8 codes: the reference's
    answer over the dequantized rows (in splits too, and with a window)."""
    run_case([(0, 9), (20, 1), (37, 1), (5, 4)], 8, 2, 64, block_size=8, int8=True, seed=13,
             split_blocks=split_blocks)
    run_case([(30, 1), (12, 6)], 4, 1, 80, block_size=8, int8=True, window=11, seed=14,
             split_blocks=split_blocks)


def test_an_int8_caches_scales_must_be_alike():
    meta = AttentionMetadata.build([0], [0, 1], [1], [[0]], 4)
    codes = torch.zeros(2, 4, 2, 64, dtype=torch.int8, device=DEVICE)
    scales = torch.ones(2, 4, 2, device=DEVICE)
    with pytest.raises(ValueError, match="scales must be contiguous"):
        paged_attention(torch.zeros(1, 4, 64, device=DEVICE), codes, codes, meta, 0.125,
                        key_scales=scales, value_scales=scales.transpose(0, 1))


# -- query tiles: a step with prefill chunks (a sequence's tokens times a group's heads) --------

def test_a_step_with_prefill_chunks_is_cut_into_query_tiles():
    from pagedllm.attention.triton_paged import TileShape, prefill_tiles, tile_shape

    lengths, new = [70, 21, 40], [70, 1, 35]
    starts = [0, 70, 71, 106]
    tables = [list(range(i * 5, i * 5 + 5)) for i in range(3)]
    slots = [0] * starts[-1]
    meta = AttentionMetadata.build(slots, starts, lengths, tables, 16)
    tiles = prefill_tiles(meta, 32).tolist()
    assert list(zip(*tiles)) == [(0, 0, 32), (0, 32, 32), (0, 64, 6), (1, 70, 1),
                                 (2, 71, 32), (2, 103, 3)]
    assert prefill_tiles(meta, 32) is meta.prefill_tiles[32]  # once a step
    assert list(zip(*prefill_tiles(meta, 16).tolist()))[:5] == [
        (0, 0, 16), (0, 16, 16), (0, 32, 16), (0, 48, 16), (0, 64, 6)]
    decode = AttentionMetadata.build([0, 1], [0, 1, 2], [5, 9], [[0], [1]], 16)
    assert prefill_tiles(decode, 32) is None and decode.prefill_tiles is False
    assert sum(new) == starts[-1]
    bf16, f32 = torch.bfloat16, torch.float32
    # rows: a tile's tokens times the group's heads (a power of two)
    assert tile_shape(4, 128, bf16, decode=False) == TileShape(16, 64, 64)
    assert tile_shape(3, 64, bf16, decode=False) == TileShape(16, 64, 64)
    assert tile_shape(4, 256, bf16, decode=False) == TileShape(8, 32, 32)  # wide heads
    assert tile_shape(1, 64, f32, decode=False) == TileShape(32, 32, 32)  # float32 operands
    assert tile_shape(128, 64, bf16, decode=False) == TileShape(1, 128, 64)  # a wide group
    # decode: one token, its group padded to the products' least 16 rows
    assert tile_shape(4, 128, bf16, decode=True) == TileShape(1, 16, 64)
    assert tile_shape(32, 128, bf16, decode=True) == TileShape(1, 32, 64)


@pytest.mark.parametrize("case", ["plain", "window", "softcap", "int8", "bfloat16",
                                  "odd_shapes", "wide_heads"])
def test_prefills_longer_than_a_tile(case):
    """Chunks of several tiles next to decode tokens and a verifying request: each tile's
    rows see their own causal range; with a window, the later rows of a tile see nothing of
    its first blocks."""
    chunks = [(0, 70), (40, 1), (5, 45), (33, 1), (33, 1)]
    options = {"plain": {}, "window": dict(window=7), "softcap": dict(softcap=3.0),
               "int8": dict(int8=True, window=20), "bfloat16": dict(dtype=torch.bfloat16),
               "odd_shapes": dict(block_size=5, window=33), "wide_heads": dict(softcap=9.0)}[case]
    heads, kv_heads, head_dim = {"odd_shapes": (6, 3, 80), "wide_heads": (4, 2, 256)}.get(
        case, (8, 2, 64))  # 256: tiles of 16
    run_case(chunks, heads, kv_heads, head_dim, seed=21, **options)


def test_token_layout_and_an_empty_step():
    meta = AttentionMetadata.build([0, 1, 2, 9], [0, 3, 4], [3, 10], [[0], [0, 1, 2]], 4)
    seq_of_token, ctx_len, tables = token_layout(meta)
    assert seq_of_token.tolist() == [0, 0, 0, 1] and ctx_len.tolist() == [1, 2, 3, 10]
    assert tables.tolist() == [[0, 0, 0], [0, 1, 2]]
    for lengths in ([3], [3, 2], [1, 1, 1]):  # odd token counts too: both rows 16-byte aligned
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        odd = AttentionMetadata.build([0] * starts[-1], starts, [n + 4 for n in lengths],
                                      [[0, 1]] * len(lengths), 4)
        rows = token_layout(odd)[:2]
        assert all(row.data_ptr() % 16 == 0 and len(row) == starts[-1] for row in rows)
    empty = torch.empty(0, 4, 64)
    cache = torch.zeros(2, 4, 2, 64)
    meta = AttentionMetadata.build([], [0, 0], [3], [[0]], 4)
    assert paged_attention(empty, cache, cache, meta, 0.125).shape == (0, 4, 64)


# -- flash-decoding: long contexts read in splits, merged (small splits here) ----------------

@pytest.mark.parametrize("split_blocks", [1, 2, 3])
def test_split_contexts_merge_to_the_same_answer(split_blocks):
    """Decode tokens and a verifying request's single-token queries (a step without prefill
    chunks: those take the query tiles), with contexts of 1 to 9 blocks of 8, split (the
    widest table being over 1-3 blocks) among MAX_SPLITS, each context by its own length
    (empty splits included)."""
    run_case([(0, 1), (16, 1), (40, 1), (70, 1), (33, 1), (33, 1), (34, 1)], 8, 2, 64,
             block_size=8, seed=split_blocks, split_blocks=split_blocks)


def test_max_splits_each_longer_and_short_contexts_among_them():
    """25 blocks of 4 among MAX_SPLITS splits: 2 blocks each; the short contexts beside it
    divided among the same splits, by their own lengths (1 and 4 blocks: most splits
    empty)."""
    run_case([(99, 1), (3, 1), (60, 1), (15, 1)], 4, 2, 64, block_size=4, seed=9,
             split_blocks=1)


def test_split_contexts_with_windows_and_soft_caps():
    run_case([(37, 1), (60, 1), (5, 1)], 4, 2, 64, block_size=8, softcap=2.0, window=13,
             seed=4, split_blocks=2)


def test_split_contexts_in_half_precision():
    run_case([(50, 1), (3, 1)], 4, 1, 80, block_size=8, dtype=torch.bfloat16, seed=8,
             split_blocks=2)


def test_the_split_is_decided_by_shapes_alone():
    from pagedllm.attention.triton_paged import MAX_SPLITS, SPLIT_MAX_TOKENS, _splits

    assert _splits(1, 4, 16) == 1  # a short table: no split
    assert _splits(1, 16, 16) == 1
    # otherwise always MAX_SPLITS (one kernel variant), whatever the width
    assert _splits(1, 17, 16) == _splits(3, 100, 16) == _splits(1, 513, 16) == MAX_SPLITS
    assert _splits(SPLIT_MAX_TOKENS + 1, 100, 16) == 1  # programs enough
