"""Q4_K and Q6_K read in their own layouts against the forms they ran as before, at one
activation row (a decode step of one request), where reading the weights is the cost.

    .venv/bin/python benchmarks/k_quant_kernels.py [--threads 2] [--repeats 15]

Per shape of a 1.7B model (hidden 2048, intermediate 8192) and enough random matrices to
stream ~400 MB from memory (no cache holds them): q4_gemm on Q4_K's two-level layout
(q4k_pack, 4.625 bits a weight) against its per-32 float16 form (q4_pack, 5 bits), and
q6_gemm (q6_pack, 6.56 bits) against the Q8_0 rounding q8_gemm read (8.5 bits); and Q4_K
with 16-bit integer activations (q4_i16_gemm, Intel's choice: kernels/cpu.py). The forms
take turns within each repeat, so both meet the same moment of a shared host's memory
bandwidth; prints medians, GB/s of packed bytes, and each new form's speed-up.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from timing import add_smoke, smoke_or

SHAPES = [(2048, 2048), (16384, 2048), (2048, 8192)]  # o / q+k, gate_up, down
STREAM_BYTES = 400 << 20


def forms(ops, n: int, k: int, gen: torch.Generator) -> dict[str, tuple]:
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 256, generator=gen) * 1e-3).half().float()
    per_group = d.repeat_interleave(8, 1) * scales.float()  # what q4_pack took for Q4_K
    codes6 = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=gen)
    scales6 = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=gen)
    codes8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    two_level = ops.q4k_pack(codes, scales, scales, d, d)
    return {
        "Q4_K per-32 (before)": (ops.q4_gemm, ops.q4_pack(codes, per_group.half().float(), -per_group.half().float())),
        "Q4_K two-level": (ops.q4_gemm, two_level),
        "Q4_K two-level, int16": (ops.q4_i16_gemm, two_level),
        "Q6_K as Q8_0 (before)": (ops.q8_gemm, ops.q8_pack(codes8, per_group)),
        "Q6_K 6-bit": (ops.q6_gemm, ops.q6_pack(codes6, scales6, d)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    add_smoke(parser)
    args = parser.parse_args()
    args.repeats = smoke_or(args.repeats, 1)
    torch.set_num_threads(args.threads)
    from pagedllm.kernels import kernel_ops

    ops = kernel_ops()
    gen = torch.Generator().manual_seed(0)
    print(f"kernels: {ops.isa()}, {args.threads} thread(s), one activation row")
    for n, k in SHAPES:
        copies = smoke_or(max(2, STREAM_BYTES // (n * k)), 1)
        matrices = [forms(ops, n, k, gen) for _ in range(copies)]
        x = torch.randn(1, k).bfloat16()
        times = {name: [] for name in matrices[0]}
        for _ in range(args.repeats):
            for name in times:
                start = time.perf_counter()
                for m in matrices:
                    gemm, packed = m[name]
                    gemm(x, packed)
                times[name].append((time.perf_counter() - start) / copies)
        median = {name: statistics.median(t) for name, t in times.items()}
        print(f"\n{n} x {k} ({copies} matrices a pass)")
        for name, seconds in median.items():
            size = matrices[0][name][1].numel()
            print(f"  {name:<26} {seconds * 1e3:7.3f} ms  {size / 2**20:6.2f} MiB  {size / seconds / 1e9:5.1f} GB/s")
        print(f"  Q4_K two-level: {median['Q4_K per-32 (before)'] / median['Q4_K two-level']:.2f}x; "
              f"int16 activations on it: {median['Q4_K two-level'] / median['Q4_K two-level, int16']:.2f}x; "
              f"Q6_K 6-bit: {median['Q6_K as Q8_0 (before)'] / median['Q6_K 6-bit']:.2f}x")


if __name__ == "__main__":
    main()
