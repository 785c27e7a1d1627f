"""Prefill attention through torch's fused SDPA beside the C++ kernels (BatchedBackend's
prefill_sdpa, chosen by Backend.prefill_sdpa where the AMX tiles are in use): the same
answers as the plain-torch reference for whole prompts, continued chunks and decode rows in
one step, on any host (the route is torch's, so CI runs it everywhere); the kernel keeps what
SDPA cannot take (Gemma's and Mistral's options, int8 caches); and only an AMX host's
backend chooses it."""
import dataclasses

import pytest
import torch

from pagedllm.attention import AttentionMetadata, LayerKVCache
from pagedllm.attention.batched import SDPA_MIN_SCORES, BatchedBackend
from pagedllm.attention.layer_cache import quantize_rows
from pagedllm.attention.softcap import SoftcapBackend
from pagedllm.backends.cpu import cpu_backend
from pagedllm.kernels import kernel_ops

pytestmark = pytest.mark.skipif(kernel_ops() is None, reason="the C++ kernels did not build")

BLOCK = 16


class CountingKernels:
    """The compiled module, counting its prefill attention calls."""

    def __init__(self, ops):
        self._ops = ops
        self.prefill_calls = 0

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def paged_prefill_attention(self, *args):
        self.prefill_calls += 1
        return self._ops.paged_prefill_attention(*args)


def step(shape, lens, queries, dtype=torch.bfloat16, quantized=False, seed=0):
    """A step over scattered blocks: sequences of `lens` tokens whose last `queries` tokens
    are this step's. (query, the cache, the same cache in float32, metadata)."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim = shape
    num_blocks = sum(-(-n // BLOCK) for n in lens) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[order.pop() for _ in range(-(-n // BLOCK))] for n in lens]
    key = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=g)
    value = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=g)
    if quantized:
        (kc, ks), (vc, vs) = quantize_rows(key), quantize_rows(value)
        cache = LayerKVCache(kc, vc, ks, vs)
        everything = slice(None)
        reference = LayerKVCache(cache.keys(everything), cache.values(everything))
    else:
        cache = LayerKVCache(key.to(dtype), value.to(dtype))
        reference = LayerKVCache(cache.key.float(), cache.value.float())
    query = torch.randn(sum(queries), heads, head_dim, generator=g).to(dtype)
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK
             for t, n, q in zip(tables, lens, queries) for p in range(n - q, n)]
    starts = [sum(queries[:i]) for i in range(len(queries) + 1)]
    return query, cache, reference, AttentionMetadata.build(slots, starts, lens, tables, BLOCK)


# A whole prompt, a chunk continuing a sequence, and a decode row, in one step; the chunks
# large enough for SDPA at every shape below, and a short prompt that stays on the kernel.
LENS, QUERIES = [190, 240, 23], [190, 150, 1]
SHORT = ([40, 23], [40, 1])


@pytest.mark.parametrize("shape", [(9, 3, 64), (32, 32, 64), (8, 2, 128), (8, 2, 80)])
def test_prefill_through_sdpa_matches_the_reference_and_skips_the_kernel(shape):
    query, cache, reference_cache, meta = step(shape, LENS, QUERIES)
    kernels = CountingKernels(kernel_ops())
    backend = BatchedBackend(*shape, kernels, prefill_sdpa=True)
    out = backend.forward(query, cache, meta)
    reference = SoftcapBackend(*shape).forward(query.float(), reference_cache, meta)
    assert out.dtype == torch.bfloat16 and out.shape == (sum(QUERIES), shape[0] * shape[2])
    assert (out.float() - reference).abs().max() < 2e-2
    assert kernels.prefill_calls == 0
    # and the kernel's own answer is the same attention
    kernel_out = BatchedBackend(*shape, kernels).forward(query, cache, meta)
    assert kernels.prefill_calls == 2
    assert (kernel_out.float() - out.float()).abs().max() < 2e-2


def test_a_short_chunk_stays_on_the_kernel():
    shape = (9, 3, 64)
    query, cache, reference_cache, meta = step(shape, *SHORT, seed=3)
    assert 9 * 40 * 40 < SDPA_MIN_SCORES <= 9 * 190 * 190 and 8 * 150 * 240 >= SDPA_MIN_SCORES
    kernels = CountingKernels(kernel_ops())
    out = BatchedBackend(*shape, kernels, prefill_sdpa=True).forward(query, cache, meta)
    reference = SoftcapBackend(*shape).forward(query.float(), reference_cache, meta)
    assert kernels.prefill_calls == 1 and (out.float() - reference).abs().max() < 2e-2


@pytest.mark.parametrize("options", [{"scale": 0.07, "softcap": 50.0}, {"window": 20}])
def test_gemma_and_mistral_options_stay_on_the_kernel(options):
    shape = (8, 2, 64)
    query, cache, reference_cache, meta = step(shape, LENS, QUERIES, seed=1)
    kernels = CountingKernels(kernel_ops())
    backend = BatchedBackend(*shape, kernels, prefill_sdpa=True, **options)
    assert not backend.prefill_sdpa
    out = backend.forward(query, cache, meta)
    reference = SoftcapBackend(*shape, **options).forward(query.float(), reference_cache, meta)
    assert kernels.prefill_calls == 2 and (out.float() - reference).abs().max() < 2e-2


def test_an_int8_cache_stays_on_the_kernel():
    shape = (9, 3, 64)
    query, cache, reference_cache, meta = step(shape, LENS, QUERIES, dtype=torch.float32,
                                               quantized=True, seed=2)
    kernels = CountingKernels(kernel_ops())
    out = BatchedBackend(*shape, kernels, prefill_sdpa=True).forward(query, cache, meta)
    reference = SoftcapBackend(*shape).forward(query.float(), reference_cache, meta)
    assert kernels.prefill_calls == 2 and (out - reference).abs().max() < 8e-2


def test_only_a_backend_on_the_tiles_chooses_sdpa():
    here = cpu_backend()
    with_tiles = dataclasses.replace(here, cpu=dataclasses.replace(here.cpu, amx=True))
    without = dataclasses.replace(here, cpu=dataclasses.replace(here.cpu, amx=False))
    assert with_tiles.prefill_sdpa and not without.prefill_sdpa
    assert not dataclasses.replace(with_tiles, kernels=None).prefill_sdpa  # torch's path anyway
    assert not dataclasses.replace(with_tiles, name="torch").prefill_sdpa  # the generic path
    assert here.prefill_sdpa == here.cpu.amx


def test_the_model_built_here_routes_prefill_as_its_backend_says():
    from pagedllm.engine.engine import LLMEngine

    engine = LLMEngine(None, dtype="bfloat16", kv_cache_memory=16 << 20, max_model_len=256)
    stack = engine.runner.model
    backends = [module.backend for module in stack.modules() if isinstance(
        getattr(module, "backend", None), BatchedBackend)]
    assert backends and all(b.prefill_sdpa == cpu_backend().prefill_sdpa for b in backends)
