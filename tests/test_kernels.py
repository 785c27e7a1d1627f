"""The C++ paged decode attention kernel against the torch reference backend."""
import pytest
import torch

from pagedllm.attention import AttentionMetadata, TorchReferenceBackend
from pagedllm.attention.batched import BatchedBackend
from pagedllm.kernels import paged_attention_ops


@pytest.fixture(scope="module")
def ops():
    module = paged_attention_ops()
    assert module is not None, "the C++ kernel must build here (make install builds it)"
    return module


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
    slot_view = key_cache.view(-1, kv_heads, head_dim)
    new_k = slot_view[torch.tensor(slots)].clone()
    new_v = value_cache.view(-1, kv_heads, head_dim)[torch.tensor(slots)].clone()
    reference = TorchReferenceBackend(heads, kv_heads, head_dim).forward(
        query.float(), new_k.float(), new_v.float(), (key_cache.float(), value_cache.float()), meta)
    batch = meta.decode_batch()
    out = ops.paged_decode_attention(query, key_cache, value_cache, batch.block_tables,
                                     batch.seq_lens, head_dim ** -0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float().flatten(1) - reference).abs().max() < tolerance


def test_backend_uses_kernel_only_for_supported_shapes(ops):
    assert BatchedBackend(9, 3, 64).kernel is not None
    assert BatchedBackend(4, 2, 16).kernel is None  # tiny test models take the torch path
    assert BatchedBackend(9, 3, 64, use_kernel=False).kernel is None


def test_kernel_rejects_bad_input(ops):
    q = torch.randn(2, 9, 64)
    cache = torch.randn(4, 16, 3, 64)
    with pytest.raises(RuntimeError, match="int64"):
        ops.paged_decode_attention(q, cache, cache, torch.zeros(2, 1, dtype=torch.int32),
                                   torch.ones(2, dtype=torch.long), 0.1)
    with pytest.raises(RuntimeError, match="dtypes"):
        ops.paged_decode_attention(q.bfloat16(), cache, cache, torch.zeros(2, 1, dtype=torch.long),
                                   torch.ones(2, dtype=torch.long), 0.1)
