"""Gemma's attention in the C++ kernels against the plain-torch path it ran on before
(attention/softcap.py, one sequence at a time), at Gemma's shapes.

    .venv/bin/python benchmarks/attention_options.py [--threads 2]

Gemma 2 2B: 8 query heads over 4 KV heads of 256, scores soft-capped at 50, query scale
256^-0.5; a global layer and a sliding one (window 4096, wider than these contexts: the cost
of the cap and the head size). Gemma 3 1B: 4 query heads over 1 KV head of 256, a sliding
layer with its 512-token window over longer contexts (slid-out blocks are never read).
Decode: 8 sequences of 1,500 tokens, one query each. Prefill: a 256-token chunk continuing
a 1,244-token sequence. bfloat16, blocks of 16 scattered at random; one layer's cache, read
from memory each call (16 caches in turn).
"""
from __future__ import annotations

import torch

from pagedllm.attention import AttentionMetadata, LayerKVCache
from pagedllm.attention.batched import BatchedBackend
from pagedllm.attention.softcap import SoftcapBackend
from pagedllm.kernels import kernel_ops
import timing
from timing import allocate_as_a_loaded_engine, ms_per_call, parse_args, smoke_or

BLOCK = 16
CASES = {  # name: heads, kv_heads, softcap, window
    "Gemma 2 2B, global": (8, 4, 50.0, None),
    "Gemma 2 2B, sliding 4096": (8, 4, 50.0, 4096),
    "Gemma 3 1B, sliding 512": (4, 1, None, 512),
}
HEAD_DIM = 256


def layout(lens: list[int], queries: list[int]):
    blocks = [-(-n // BLOCK) for n in lens]
    order = torch.randperm(sum(blocks) + 1).tolist()
    tables = [[order.pop() for _ in range(b)] for b in blocks]
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t, n, q in zip(tables, lens, queries)
             for p in range(n - q, n)]
    starts = [0]
    for q in queries:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata.build(slots, starts, lens, tables, BLOCK)
    return meta, sum(blocks) + 1


def case(heads: int, kv_heads: int, softcap, window, lens: list[int], queries: list[int]):
    meta, num_blocks = layout(lens, queries)
    caches = [LayerKVCache(torch.randn(num_blocks, BLOCK, kv_heads, HEAD_DIM).bfloat16(),
                           torch.randn(num_blocks, BLOCK, kv_heads, HEAD_DIM).bfloat16())
              for _ in range(smoke_or(16, 2))]
    query = torch.randn(sum(queries), heads, HEAD_DIM).bfloat16()
    options = dict(scale=HEAD_DIM ** -0.5, softcap=softcap, window=window)
    plain = SoftcapBackend(heads, kv_heads, HEAD_DIM, **options)
    kernel = BatchedBackend(heads, kv_heads, HEAD_DIM, kernel_ops(), **options)
    assert kernel.kernel is not None
    turn = iter(range(10 ** 9))
    times = [ms_per_call(lambda b=b: b.forward(query, caches[next(turn) % len(caches)], meta),
                         repeat=16)
             for b in (plain, kernel)]
    return times


def main() -> None:
    args = parse_args()
    allocate_as_a_loaded_engine()
    torch.manual_seed(0)
    print(f"threads={args.threads}, bfloat16, head_dim {HEAD_DIM}; ms per layer call")
    print(f"{'case':<26} {'step':<28} {'plain torch':>12} {'C++ kernel':>11} {'speed-up':>9}")
    for name, (heads, kv_heads, softcap, window) in CASES.items():
        steps = (("decode, 8 x 1,500 tokens", [1500] * 8, [1] * 8),
                 ("prefill, 256 after 1,244", [1500], [256]))
        if timing.SMOKE:
            steps = (("decode, 2 x 48 tokens", [48] * 2, [1] * 2), ("prefill, 16 after 32", [48], [16]))
        for step, lens, queries in steps:
            plain, kernel = case(heads, kv_heads, softcap, window, lens, queries)
            print(f"{name:<26} {step:<28} {plain:12.2f} {kernel:11.2f} {plain / kernel:8.1f}x")


if __name__ == "__main__":
    main()
