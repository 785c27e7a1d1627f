"""The attention kernels at the shapes and options of the models teams run, at every CPU
level: head sizes 64, 80 (Phi-2), 96 (Phi-3-small), 128 and 256 (Gemma), query groups above 8
(split into equal tasks), and Gemma's / Mistral's options (own query scale, soft-capped
scores, sliding window), each against the plain-torch SoftcapBackend, over float, bfloat16 and
int8 caches. A window's slid-out blocks hold NaN here: the kernels must never read them."""
import pytest
import torch

from pagedllm.attention import AttentionMetadata, LayerKVCache
from pagedllm.attention.batched import BatchedBackend
from pagedllm.kernels import kernel_ops
from pagedllm.attention.layer_cache import quantize_rows
from pagedllm.attention.softcap import SoftcapBackend

# (heads, kv_heads, head_dim): group 4 at 80, 3 at 96, 2 at 256, 16 on one KV head (two tasks
# of 8), 11 (prime: eleven tasks of 1), 10 (two of 5).
SHAPES = [(8, 2, 80), (12, 4, 96), (8, 4, 256), (16, 1, 64), (22, 2, 128), (10, 1, 80)]
# (scale, softcap, window): none; Gemma 2's softcap with its own scale; a window shorter
# than the contexts; both.
OPTIONS = [(None, None, None), (0.07, 50.0, None), (None, None, 20), (0.2, 30.0, 7)]
# int8: the query is rounded to int8 for q.k (as llama.cpp rounds it against a q8_0 cache);
# at head size 256 and a scale of 0.2 that moves outputs by up to ~0.05.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, "int8": 8e-2}


def layout(lens: list[int], block_size: int, num_blocks: int) -> list[list[int]]:
    order = torch.randperm(num_blocks).tolist()
    return [[order.pop() for _ in range(-(-n // block_size))] for n in lens]


def caches(shape, dtype, cache_kind):
    """(the cache the kernel reads, the same numbers as a float cache for the reference)."""
    key, value = torch.randn(shape), torch.randn(shape)
    if cache_kind == "int8":
        (kc, ks), (vc, vs) = quantize_rows(key), quantize_rows(value)
        cache = LayerKVCache(kc, vc, ks, vs)
        everything = slice(None)
        return cache, LayerKVCache(cache.keys(everything), cache.values(everything))
    cache = LayerKVCache(key.to(dtype), value.to(dtype))
    return cache, LayerKVCache(cache.key.float().clone(), cache.value.float().clone())


def hide_slid_out_blocks(cache: LayerKVCache, tables, lens, queries, window, block_size):
    """NaN in every block wholly before the first query's window, as if back in the pool and
    reused: a kernel that reads one gives NaN."""
    if window is None or cache.key.dtype == torch.int8:
        return
    for table, n, q in zip(tables, lens, queries):
        first = max(0, n - q - window + 1)
        for block in table[:first // block_size]:
            cache.key[block] = float("nan")
            cache.value[block] = float("nan")


def kernel_backend(heads, kv_heads, head_dim, **options):
    backend = BatchedBackend(heads, kv_heads, head_dim, kernel_ops(), **options)
    assert backend.kernel is not None and backend.fallback is None
    return backend


def assert_kernels_match_plain_torch(shape, options, cache_kind, lens, queries, block_size,
                                     num_blocks):
    """Sequences of `lens` tokens, the last `queries` of each in this step, over scattered
    blocks: the kernels' answer (through BatchedBackend) against SoftcapBackend's."""
    heads, kv_heads, head_dim = shape
    dtype = torch.float32 if cache_kind == "int8" else cache_kind
    tables = layout(lens, block_size, num_blocks)
    cache, reference_cache = caches((num_blocks, block_size, kv_heads, head_dim), dtype, cache_kind)
    hide_slid_out_blocks(cache, tables, lens, queries, options["window"], block_size)
    query = torch.randn(sum(queries), heads, head_dim).to(dtype)
    slots = [t[p // block_size] * block_size + p % block_size
             for t, n, q in zip(tables, lens, queries) for p in range(n - q, n)]
    starts = [sum(queries[:i]) for i in range(len(queries) + 1)]
    meta = AttentionMetadata.build(slots, starts, lens, tables, block_size)
    reference = SoftcapBackend(*shape, **options).forward(query.float(), reference_cache, meta)
    out = kernel_backend(*shape, **options).forward(query, cache, meta)
    assert out.dtype == dtype and not out.isnan().any()
    assert (out.float() - reference).abs().max() < TOLERANCE[cache_kind]


@pytest.mark.parametrize("cache_kind", [torch.float32, torch.bfloat16, "int8"])
@pytest.mark.parametrize("scale,softcap,window", OPTIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_attention_at_model_shapes(at_isa, shape, scale, softcap, window, cache_kind):
    torch.manual_seed(0)
    lens = [1, 9, 150, 8, 45, 21]
    assert_kernels_match_plain_torch(shape, dict(scale=scale, softcap=softcap, window=window),
                                     cache_kind, lens, [1] * len(lens), 8, 80)


@pytest.mark.parametrize("cache_kind", [torch.float32, torch.bfloat16, "int8"])
@pytest.mark.parametrize("scale,softcap,window", OPTIONS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("start,chunk,block_size", [(0, 53, 16), (45, 38, 8)])
def test_prefill_attention_at_model_shapes(at_isa, shape, scale, softcap, window, cache_kind,
                                           start, chunk, block_size):
    """bfloat16 chunks take the tiled kernel (avx512: head sizes that are a multiple of 32;
    avx2: every size), the rest the per-token one; both see the window from each token, not
    from the chunk."""
    torch.manual_seed(4)
    assert_kernels_match_plain_torch(shape, dict(scale=scale, softcap=softcap, window=window),
                                     cache_kind, [start + chunk], [chunk], block_size, 64)


def test_backend_without_the_kernel_falls_back_to_plain_torch_for_options():
    """A head size the kernels lack (16, the tiny test models') still honours the options."""
    backend = BatchedBackend(4, 2, 16, softcap=50.0, window=8)
    assert backend.kernel is None and isinstance(backend.fallback, SoftcapBackend)
    assert backend.fallback.window == 8 and backend.fallback.softcap == 50.0
    assert BatchedBackend(4, 2, 16).fallback is None  # no options: the batched torch path


def test_kernels_refuse_an_unsupported_head_size_and_negative_options(ops):
    q = torch.randn(2, 4, 48)
    cache = torch.randn(4, 16, 2, 48)
    tables, lens = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="head_dim must be 64, 80, 96, 128 or 256"):
        ops.paged_decode_attention(q, cache, cache, tables, lens, 0.1)
    q, cache = torch.randn(2, 4, 64), torch.randn(4, 16, 2, 64)
    with pytest.raises(RuntimeError, match="softcap and window must be >= 0"):
        ops.paged_decode_attention(q, cache, cache, tables, lens, 0.1, window=-1)
    with pytest.raises(RuntimeError, match="softcap and window must be >= 0"):
        ops.paged_prefill_attention(q, cache, cache, torch.tensor([0]), 0, 0.1, softcap=-2.0)
