"""int4 (torch CPU kernel) vs dense bfloat16 vs float32 linear layers at the model's shapes.

    .venv/bin/python benchmarks/linear_kernels.py [--threads 2]

Prints microseconds per call by batch rows and the ratio dense-bf16 / int4; the row count
where int4 stops winning sets INT4_MAX_ROWS in pagedllm/models/quant_linear.py.
"""
from __future__ import annotations

import argparse
import time

import torch

from pagedllm.weights.q4 import GROUP_SIZE

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def timeit(fn, repeat=200) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads}; microseconds per call for all four projections of a layer")
    print(f"{'rows':>5} {'fp32':>8} {'bf16':>8} {'int4':>8}  bf16/int4")
    weights = {}
    for name, (out, inp) in SHAPES.items():
        codes = torch.randint(0, 16, (out, inp), dtype=torch.int32)
        scales = torch.rand(out, inp // GROUP_SIZE) * 0.01
        zeros = torch.rand(out, inp // GROUP_SIZE) * 0.01
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        sz = torch.stack([scales.T, zeros.T], dim=-1).bfloat16().contiguous()
        dense = torch.randn(out, inp)
        weights[name] = (dense, dense.bfloat16(), packed, sz, inp)
    for rows in (1, 2, 4, 8, 12, 16, 32, 64, 256):
        totals = [0.0, 0.0, 0.0]
        for dense, dense_bf16, packed, sz, inp in weights.values():
            x = torch.randn(rows, inp)
            xb = x.bfloat16()
            totals[0] += timeit(lambda: torch.nn.functional.linear(x, dense))
            totals[1] += timeit(lambda: torch.nn.functional.linear(xb, dense_bf16))
            totals[2] += timeit(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, GROUP_SIZE, sz))
        print(f"{rows:>5} {totals[0]:8.0f} {totals[1]:8.0f} {totals[2]:8.0f}  {totals[1] / totals[2]:.2f}x")


if __name__ == "__main__":
    main()
