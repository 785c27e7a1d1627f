"""Prefill's GEMMs against this host's own peaks: how much of the int8 and float32 arithmetic
rate the 4-bit and 6-bit prefill kernels reach.

    .venv/bin/python benchmarks/prefill_peak.py --model PATH [--rows 512]

Peaks, measured here with the best-tuned library on the machine (oneDNN through torch):
float32 GEMM (torch.matmul) and int8 GEMM (torch._int_mm, u8/s8 dot products: VNNI on
AVX-512, vpmaddubsw on AVX2), 2048^3, best of 5. Ours: every distinct projection of the
model (PATH: a Q4_K_M-layout file such as `benchmarks/speculative.py verify-cost` writes) at
`rows` rows, as prefill runs them (activations rounded to int8: q4_q8_gemm, q6_gemm), and
the 4-bit ones with exact bf16 activations (q4_gemm) for comparison; each in GOP/s
(2 * rows * in * out per call) and as a fraction of the int8 peak.
"""
from __future__ import annotations

import argparse
import time

import torch

from pagedllm import LLM
from pagedllm.models.quant_linear import Int8ActivationLinear, QuantLinear


def best_seconds(fn, repeat: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def peaks(n: int = 2048) -> tuple[float, float | None]:
    a, b = torch.randn(n, n), torch.randn(n, n)
    fp32 = 2 * n ** 3 / best_seconds(lambda: a @ b) / 1e9
    try:
        x = torch.randint(-100, 100, (n, n), dtype=torch.int8)
        w = torch.randint(-100, 100, (n, n), dtype=torch.int8)
        int8 = 2 * n ** 3 / best_seconds(lambda: torch._int_mm(x, w)) / 1e9
    except (RuntimeError, AttributeError):
        int8 = None
    return fp32, int8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=int, default=512)
    args = parser.parse_args()
    fp32, int8 = peaks()
    print(f"{torch.get_num_threads()} threads; peaks: float32 {fp32:,.0f} GFLOP/s, int8 "
          + (f"{int8:,.0f} GOP/s" if int8 else "unavailable (torch._int_mm)"))
    llm = LLM(args.model, dtype="bfloat16", exact_activations=False, kv_cache_memory=64 << 20,
              max_model_len=256)
    seen = set()
    x_cache = {}
    for name, module in llm.engine.runner.model.named_modules():
        if not isinstance(module, (QuantLinear, Int8ActivationLinear)):
            continue
        kind = type(module).__name__
        key = (kind, name.split(".")[-1])
        if key in seen:
            continue
        seen.add(key)
        width = _fan_in(module, llm.engine.model_config)
        x = x_cache.setdefault(width, torch.randn(args.rows, width).to(torch.bfloat16))
        out = module(x[:1]).shape[-1]
        ops = 2 * args.rows * width * out
        if isinstance(module, QuantLinear) and module.q4_ops is not None:
            int8_s = best_seconds(lambda: module.q4_ops.q4_linear(x, module.packed, 0))
            exact_s = best_seconds(lambda: module.q4_ops.q4_linear(x, module.packed, 1 << 62))
            label, rate, exact = "q4_q8_gemm", ops / int8_s / 1e9, ops / exact_s / 1e9
        else:
            label, rate, exact = module.gemm.__name__ if hasattr(module.gemm, "__name__") else kind, \
                ops / best_seconds(lambda: module(x)) / 1e9, None
        share = f"{rate / int8:.0%} of int8 peak" if int8 else ""
        print(f"  {key[1]:14s} {width:5d} -> {out:6d} {label:12s} {rate:7,.0f} GOP/s  {share}"
              + (f"; exact bf16 (q4_gemm) {exact:,.0f} GFLOP/s = {exact / fp32:.0%} of float32 peak"
                 if exact else ""))


def _fan_in(module, config) -> int:
    """A projection's input width: the one of the model's widths it accepts."""
    for width in (config.hidden_size, config.num_heads * config.head_dim, config.intermediate_size):
        try:
            module(torch.zeros(1, width, dtype=torch.bfloat16))
            return width
        except RuntimeError:
            continue
    raise RuntimeError(f"cannot tell the input width of {module}")


if __name__ == "__main__":
    main()
