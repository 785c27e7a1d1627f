"""The kernels of each CPU level this host runs, against the portable build measured in the
same run (the baseline: plain C++, what an unknown CPU gets).

    .venv/bin/python benchmarks/cpu_levels.py [--threads 2]

At the default model's shapes: the 4-bit projections of 30 layers (q4_gemm exact, and
q4_q8_gemm with int8-rounded activations), the Q8_0 output head (q8_gemm, 49152 x 576), and
decode attention over a bfloat16 and an int8 cache (8 sequences x 600 tokens, 30 layers).
Prints milliseconds per pass and each level's speed-up over portable.
"""
from __future__ import annotations

import torch

from attention_kernels import BLOCK, HEAD_DIM, HEADS, KV_HEADS, int8_cache
from linear_kernels import NUM_LAYERS, SHAPES
from pagedllm.kernels import capabilities, kernels_for
from timing import allocate_as_a_loaded_engine, ms_per_call, parse_args, smoke_or


def make_weights():
    """Per layer and projection: codes, d, m (random, as a Q4_1 file holds them)."""
    torch.manual_seed(0)
    return [(torch.randint(0, 16, (out, inp), dtype=torch.uint8), torch.rand(out, inp // 32) * 0.01,
             torch.rand(out, inp // 32) * -0.1) for _ in range(smoke_or(NUM_LAYERS, 1)) for out, inp in SHAPES.values()]


def gemm_cases(ops, weights, rows_list):
    packed = [(ops.q4_pack(c, d, m), c.shape[1]) for c, d, m in weights]
    results = {}
    for rows in rows_list:
        inputs = {inp: torch.randn(rows, inp).bfloat16() for inp in (576, 1536)}
        for kind in ("q4_gemm", "q4_q8_gemm"):
            fn = getattr(ops, kind)
            results[(kind, rows)] = ms_per_call(lambda: [fn(inputs[inp], p) for p, inp in packed], 5)
    return results


def head_cases(ops, rows_list):
    torch.manual_seed(1)
    heads = [ops.q8_pack(torch.randint(-127, 128, (49152, 576), dtype=torch.int8),
                         (torch.rand(49152, 18) * 0.01).half().float()) for _ in range(2)]
    return {("q8_gemm head", rows): ms_per_call(
        lambda x=torch.randn(rows, 576).bfloat16(): [ops.q8_gemm(x, h) for h in heads], 10) / len(heads)
        for rows in rows_list}


def attention_cases(ops, seqs=8, length=600):
    torch.manual_seed(2)
    blocks = -(-length // BLOCK)
    num_blocks = seqs * blocks + 1
    tables = torch.randperm(num_blocks)[: seqs * blocks].view(seqs, blocks)
    lens = torch.full((seqs,), length, dtype=torch.long)
    query = torch.randn(seqs, HEADS, HEAD_DIM).bfloat16()
    caches = []
    for _ in range(smoke_or(NUM_LAYERS, 1)):
        key = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
        value = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
        codes = int8_cache(key, value)
        caches.append(((key, value), (codes.key, codes.value, codes.key_scale, codes.value_scale)))
    scale = HEAD_DIM ** -0.5
    bf16 = ms_per_call(lambda: [ops.paged_decode_attention(query, k, v, tables, lens, scale)
                                for (k, v), _ in caches], 5)
    int8 = ms_per_call(lambda: [ops.paged_decode_attention(query, kc, vc, tables, lens, scale, ks, vs)
                                for _, (kc, vc, ks, vs) in caches], 5)
    return {(f"decode attention bf16 {seqs}x{length}", seqs): bf16,
            (f"decode attention int8 {seqs}x{length}", seqs): int8}


def main() -> None:
    args = parse_args()
    allocate_as_a_loaded_engine()
    caps = capabilities()
    flags = sorted(f for f in caps.flags if f.startswith(("avx", "fma", "f16c")))
    print(f"threads={args.threads}; CPU runs up to {caps.best}; flags: {' '.join(flags)}")
    weights = make_weights()
    table = {}
    for level in caps.available:
        ops = kernels_for(level)
        results = gemm_cases(ops, weights, smoke_or((1, 8, 64, 256), (1, 8)))
        results.update(head_cases(ops, (1, 8)))
        results.update(attention_cases(ops, *smoke_or((8, 600), (2, 40))))
        table[level] = results
    levels = list(caps.available)
    print(f"{'kernel':<34} {'rows':>5} " + " ".join(f"{lvl + ' ms':>12}" for lvl in levels)
          + " " + " ".join(f"{lvl + '/portable':>16}" for lvl in levels[1:]))
    for key in table["portable"]:
        kind, rows = key
        base = table["portable"][key]
        print(f"{kind:<34} {rows:>5} " + " ".join(f"{table[lvl][key]:12.2f}" for lvl in levels)
              + " " + " ".join(f"{base / table[lvl][key]:15.2f}x" for lvl in levels[1:]))


if __name__ == "__main__":
    main()
