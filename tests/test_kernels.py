"""The C++ kernels against their torch references: paged decode and prefill attention, the fused
layer ops (RMSNorm with residual, RoPE + KV write, SiLU-and-mul)."""
import pytest
import torch

from pagedllm.attention import AttentionMetadata, LayerKVCache, TorchReferenceBackend
from pagedllm.attention.batched import BatchedBackend
from pagedllm.backends.torch_layer_ops import TorchLayerOps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 64), (16, 2, 128)])
def test_kernel_matches_reference(ops, dtype, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    block_size, num_blocks = 16, 64
    lens = [1, 17, 300, 16, 45]
    # Scattered, non-overlapping block tables.
    order = torch.randperm(num_blocks).tolist()
    tables = []
    for n in lens:
        need = -(-n // block_size)
        tables.append([order.pop() for _ in range(need)])
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, dtype=dtype)
    value_cache = torch.randn(cache_shape, dtype=dtype)
    query = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    # One decode token per sequence, already written at its last slot.
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, lens)]
    meta = AttentionMetadata.build(slots, list(range(len(lens) + 1)), lens, tables, block_size)
    reference = TorchReferenceBackend(heads, kv_heads, head_dim).forward(
        query.float(), LayerKVCache(key_cache.float(), value_cache.float()), meta)
    batch = meta.decode_batch()
    out = ops.paged_decode_attention(query, key_cache, value_cache, batch.block_tables,
                                     batch.seq_lens, head_dim ** -0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float().flatten(1) - reference).abs().max() < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (16, 2, 128)])
@pytest.mark.parametrize("start,chunk,block_size", [(0, 37, 16), (45, 20, 16), (0, 1, 16), (16, 16, 16),
                                                    (21, 70, 5), (0, 100, 32)])
def test_prefill_kernel_matches_reference(ops, dtype, heads, kv_heads, head_dim, start, chunk, block_size):
    """A chunk of one sequence (from its start or continuing it) over scattered blocks; bf16
    chunks take the tiled kernel (tiles of 16 tokens, keys 16 at a time), float32 the
    per-token one."""
    torch.manual_seed(4)
    num_blocks = 64
    seq_len = start + chunk
    table = torch.randperm(num_blocks)[: -(-seq_len // block_size)].tolist()
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, dtype=dtype)
    value_cache = torch.randn(cache_shape, dtype=dtype)
    query = torch.randn(chunk, heads, head_dim, dtype=dtype)
    slots = [table[p // block_size] * block_size + p % block_size for p in range(start, seq_len)]
    meta = AttentionMetadata.build(slots, [0, chunk], [seq_len], [table], block_size)
    reference = TorchReferenceBackend(heads, kv_heads, head_dim).forward(
        query.float(), LayerKVCache(key_cache.float(), value_cache.float()), meta)
    out = ops.paged_prefill_attention(query, key_cache, value_cache, meta.blocks_of(0),
                                      start, head_dim ** -0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float().flatten(1) - reference).abs().max() < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_takes_an_empty_chunk(ops, dtype):
    cache = torch.randn(4, 16, 3, 64, dtype=dtype)
    out = ops.paged_prefill_attention(torch.empty(0, 9, 64, dtype=dtype), cache, cache,
                                      torch.tensor([0], dtype=torch.long), 5, 0.125)
    assert out.shape == (0, 9, 64)


def test_prefill_kernel_rejects_a_chunk_past_its_blocks(ops):
    cache = torch.randn(4, 16, 3, 64)
    with pytest.raises(RuntimeError, match="past its block table"):
        ops.paged_prefill_attention(torch.randn(10, 9, 64), cache, cache,
                                    torch.tensor([0], dtype=torch.long), 10, 0.125)


def test_backend_uses_kernel_only_for_supported_shapes(ops):
    assert BatchedBackend(9, 3, 64, ops).kernel is ops
    assert BatchedBackend(4, 2, 16, ops).kernel is None  # tiny test models take the torch path
    assert BatchedBackend(9, 3, 64).kernel is None  # a backend without the C++ kernels


def test_kernel_rejects_bad_input(ops):
    q = torch.randn(2, 9, 64)
    cache = torch.randn(4, 16, 3, 64)
    with pytest.raises(RuntimeError, match="int64"):
        ops.paged_decode_attention(q, cache, cache, torch.zeros(2, 1, dtype=torch.int32),
                                   torch.ones(2, dtype=torch.long), 0.1)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.paged_decode_attention(q.double(), cache.double(), cache.double(),
                                   torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long), 0.1)
    with pytest.raises(RuntimeError, match="int8 or in the activations' dtype"):
        ops.paged_decode_attention(q.bfloat16(), cache, cache, torch.zeros(2, 1, dtype=torch.long),
                                   torch.ones(2, dtype=torch.long), 0.1)


# bf16 results may differ by one rounding step (the C++ ops round once, torch after each op).
FUSED_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 70])  # 70 rows: split across threads
def test_rms_norm_matches_torch(ops, dtype, rows):
    torch.manual_seed(1)
    x = torch.randn(rows, 576).to(dtype)
    weight = (torch.rand(576) + 0.5).to(dtype)
    tol = FUSED_TOLERANCE[dtype]
    assert torch.allclose(ops.rms_norm(x, None, weight, 1e-5),
                          TorchLayerOps.rms_norm(x, None, weight, 1e-5), atol=tol, rtol=tol)
    # With a residual: both add x into it in place, then normalise the sum.
    residual = torch.randn(rows, 576).to(dtype)
    res_fused, res_torch = residual.clone(), residual.clone()
    out = ops.rms_norm(x, res_fused, weight, 1e-5)
    expected = TorchLayerOps.rms_norm(x, res_torch, weight, 1e-5)
    assert torch.equal(res_fused, res_torch)  # the add rounds exactly as torch's
    assert torch.allclose(out, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,tokens", [(9, 3, 64, 3), (4, 2, 16, 40)])
def test_rope_write_kv_matches_torch(ops, dtype, heads, kv_heads, head_dim, tokens):
    from pagedllm.models.llama import RotaryEmbedding

    torch.manual_seed(2)
    rotary = RotaryEmbedding(head_dim, 2048, 10000.0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.randint(0, 2048, (tokens,))
    slots = torch.randperm(8 * 16)[:tokens]
    caches = []
    for _ in range(2):
        k = torch.zeros(8, 16, kv_heads, head_dim, dtype=dtype)
        caches.append((k, torch.zeros_like(k)))
    q_fused = ops.rope_write_kv(qkv, positions, rotary.cos, rotary.sin, *caches[0], slots, heads)
    q_torch = TorchLayerOps.rope_write_kv(qkv, positions, rotary.cos, rotary.sin, *caches[1],
                                          slots, heads)
    tol = FUSED_TOLERANCE[dtype]
    assert q_fused.shape == (tokens, heads, head_dim)
    assert torch.allclose(q_fused, q_torch, atol=tol, rtol=tol)
    assert torch.allclose(caches[0][0], caches[1][0], atol=tol, rtol=tol)
    assert torch.equal(caches[0][1], caches[1][1])  # V is copied as is
    assert caches[0][0].view(-1, kv_heads, head_dim)[slots].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(ops, dtype):
    torch.manual_seed(3)
    x = torch.randn(37, 2 * 1536) * 4
    x[0, :6] = torch.tensor([-1e4, -100.0, -88.0, 88.0, 100.0, 1e4])  # exp overflows here
    x = x.to(dtype)
    assert ops.silu_and_mul(x).isfinite().all()
    tol = FUSED_TOLERANCE[dtype]
    assert torch.allclose(ops.silu_and_mul(x), TorchLayerOps.silu_and_mul(x), atol=tol, rtol=tol)


def test_fused_ops_reject_bad_input(ops):
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="contiguous 2-D"):
        ops.rms_norm(x.t(), None, torch.ones(2), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_and_mul(x.double())
    with pytest.raises(RuntimeError, match="residual must match"):
        ops.rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-5)
    cache = torch.zeros(2, 4, 1, 4)
    cos = torch.ones(16, 4)
    qkv = torch.randn(1, 12)
    with pytest.raises(RuntimeError, match="slot out of the cache"):
        ops.rope_write_kv(qkv, torch.tensor([0]), cos, cos, cache, cache.clone(), torch.tensor([8]), 1)
    with pytest.raises(RuntimeError, match="position out of the RoPE table"):
        ops.rope_write_kv(qkv, torch.tensor([16]), cos, cos, cache, cache.clone(), torch.tensor([0]), 1)
    with pytest.raises(RuntimeError, match="qkv width"):
        ops.rope_write_kv(qkv, torch.tensor([0]), cos, cos, cache, cache.clone(), torch.tensor([0]), 2)
