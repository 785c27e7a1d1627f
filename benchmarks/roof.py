"""Know the roof: this host's own peaks, measured in the same run, and each 4-bit kernel's
and each served decode step's share of them.

    .venv/bin/python benchmarks/roof.py [--threads 2] [--level avx2] [--model default|PATH]
        [--rows 1,8,16,64] [--shapes 135M,1.7B,1.7B-Q4_K] [--steps 1,16] [--read-mib 1024]
        [--max-tokens 48] [--json OUT.json]

Peaks, on every kernel thread at once, at the level asked (default: the best this CPU runs;
PAGEDLLM_CPU_ISA's levels, so an AVX-512 host measures the avx2 code paths too):
  int8    multiply-adds a second in registers with the tiles' own instruction mix (avx2:
          vpmaddubsw + vpaddw; avx512: vpdpbusd): kernels/roof.cpp
  fma     float32 FMAs a second in registers
  read    bytes a second read from a 1 GiB buffer (the decode floor: a step reads every
          weight once)
Kernels: the 4-bit projections of every layer of a model's shape (each its own weights, so
they stream from memory; SHAPE-Q4_K packs them as Q4_K), per product: q4_q8_gemm (int8 activations), q4_i16_gemm (16-bit
integer activations: two int8 products a multiply-add, so its ceiling is half the int8
peak), q4_gemm (float32 FMAs): milliseconds, multiply-adds a second and their share of the
int8 peak, weight bytes a second and their share of the read peak.
Served steps: the engine alone (as `serve` builds it from its options) decoding N requests:
milliseconds a step, and the same two shares for the whole step (the model's weights times N
multiply-adds; the model file's bytes read).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Per layer, (out, in) of each 4-bit projection as the engine fuses them (qkv, o, gate_up,
# down), and the number of layers.
SHAPES = {
    "135M": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
    "1.7B": ([(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)], 24),
}
PRODUCTS = ("q4_q8_gemm", "q4_i16_gemm", "q4_gemm")


def seconds_of(fn, repeat: int = 5, best: bool = False) -> float:
    """The median (or the best) of `repeat` timed calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) if best else statistics.median(times)


def peaks(ops, read_mib: int = 1024) -> dict:
    """GMAC/s of int8 and float32 multiply-adds, GB/s of reads, on every kernel thread: the
    best of a few tries (a peak is what the machine can do; a shared host's neighbours only
    ever take from it)."""
    iterations = 2_000_000
    int8 = ops.roof_int8(iterations) / seconds_of(lambda: ops.roof_int8(iterations), best=True) / 1e9
    fma = ops.roof_fma(iterations) / seconds_of(lambda: ops.roof_fma(iterations), best=True) / 1e9
    buffer = torch.ones(read_mib << 20, dtype=torch.uint8)
    read = buffer.numel() / seconds_of(lambda: ops.roof_read(buffer), 3, best=True) / 1e9
    return {"int8_gmacs": int8, "fma_gmacs": fma, "read_gbs": read}


def with_shares(row: dict, roof: dict) -> dict:
    """The row's multiply-adds and bytes a second as shares of the peaks."""
    return {**row, "int8_share": row["gmacs"] / roof["int8_gmacs"],
            "read_share": row["gbs"] / roof["read_gbs"]}


def packed_layers(ops, shape: str) -> list[tuple[torch.Tensor, int]]:
    """Random 4-bit weights of every projection of `shape`: one (d, m) per 32 inputs (Q4_0,
    Q4_1), or two-level Q4_K (a 1.7B Q4_K_M file's 4-bit parts) where the name ends in -Q4_K."""
    base, _, kind = shape.partition("-")
    projections, layers = SHAPES[base]
    gen = torch.Generator().manual_seed(0)  # its own: the caller's random state stays as it was
    packed = []
    for _ in range(layers):
        for out, inp in projections:
            codes = torch.randint(0, 16, (out, inp), dtype=torch.uint8, generator=gen)
            if kind == "Q4_K":
                sc, mn = (torch.randint(0, 64, (out, inp // 32), dtype=torch.uint8, generator=gen) for _ in range(2))
                d, dmin = ((torch.rand(out, inp // 256, generator=gen) * 1e-3).half().float() for _ in range(2))
                packed.append((ops.q4k_pack(codes, sc, mn, d, dmin), inp))
            else:
                packed.append((ops.q4_pack(codes, torch.rand(out, inp // 32, generator=gen) * 0.01,
                                           torch.rand(out, inp // 32, generator=gen) * -0.1), inp))
    return packed


def kernel_rows(ops, shape: str, rows_list: list[int]) -> list[dict]:
    packed = packed_layers(ops, shape)
    macs_per_row = sum(p.shape[0] * 16 * inp for p, inp in packed)
    weight_bytes = sum(p.numel() for p, _ in packed)
    results = []
    for rows in rows_list:
        inputs = {inp: torch.randn(rows, inp).bfloat16() for _, inp in packed}
        for product in PRODUCTS:
            fn = getattr(ops, product)
            seconds = seconds_of(lambda: [fn(inputs[inp], p) for p, inp in packed], 3 if rows > 16 else 5)
            gmacs = macs_per_row * rows / seconds / 1e9
            gbs = weight_bytes / seconds / 1e9
            results.append({"shape": shape, "rows": rows, "product": product, "ms": seconds * 1e3,
                            "gmacs": gmacs, "gbs": gbs})
    return results


def served_steps(model: str, steps: list[int], max_tokens: int = 48) -> list[dict]:
    """ms a decode step of the engine alone at each N, its multiply-adds and bytes a second."""
    import host_overhead
    from pagedllm.cli.options import engine_config
    from pagedllm.cli.serve import add_serve_args
    from pagedllm.model_config import num_parameters
    from pagedllm.core.request import SamplingParams
    from pagedllm.engine.engine import LLMEngine

    path = host_overhead.model_path(model)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    engine = LLMEngine(engine_config(parser.parse_args(host_overhead.serve_args(path, max(steps), []))))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    macs_per_token = num_parameters(engine.model_config)
    file_bytes = os.path.getsize(path)
    results = []
    for n in [steps[0], *steps]:  # the first N twice: its first round warms up
        for i in range(n):
            engine.add_request(f"{n}-{i}-{time.perf_counter()}", host_overhead.PROMPT, params)
        durations = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            outputs = engine.step()
            # decode steps only: every request in the step made one token, none was prefilling
            if len(outputs) == n and all(len(o.new_token_ids) == 1 for o in outputs):
                durations.append(time.perf_counter() - start)
        seconds = statistics.median(durations[2:] or durations)
        results.append({"n": n, "ms": seconds * 1e3, "gmacs": macs_per_token * n / seconds / 1e9,
                        "gbs": file_bytes / seconds / 1e9})
    return results[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--level", default=None, help="a kernel level (default: this CPU's best)")
    parser.add_argument("--model", default="default", help="served steps' model (default: the default one)")
    parser.add_argument("--rows", default="1,8,16,64")
    parser.add_argument("--shapes", default="135M,1.7B,1.7B-Q4_K")
    parser.add_argument("--steps", default="1,16", help="N of the served decode steps ('' for none)")
    parser.add_argument("--read-mib", type=int, default=1024,
                        help="the read peak's buffer (far larger than the caches)")
    parser.add_argument("--max-tokens", type=int, default=48, help="a served request's tokens")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.level:
        os.environ["PAGEDLLM_CPU_ISA"] = args.level
    torch.set_num_threads(args.threads)
    from pagedllm.kernels import capabilities, kernels_for
    from timing import allocate_as_a_loaded_engine

    allocate_as_a_loaded_engine()
    caps = capabilities()
    ops = kernels_for(caps.level)
    flags = " ".join(sorted(f for f in caps.flags if f.startswith(("avx", "fma", "f16c", "amx"))))
    print(f"level {caps.level} (CPU runs up to {caps.best}), {args.threads} threads; flags: {flags}")
    before = peaks(ops, args.read_mib)
    rows = [int(r) for r in args.rows.split(",") if r]
    kernels = [row for shape in args.shapes.split(",") if shape for row in kernel_rows(ops, shape, rows)]
    steps = [int(n) for n in args.steps.split(",") if n]
    served = served_steps(args.model, steps, args.max_tokens) if steps else []
    # The peaks again after the work, the better of each: the shares are of what this host
    # showed it can do during the run, not of a moment a neighbour took part of it.
    after = peaks(ops, args.read_mib)
    roof = {key: max(before[key], after[key]) for key in before}
    print(f"peaks (best of before and after): int8 {roof['int8_gmacs']:.1f} GMAC/s, float32 FMA "
          f"{roof['fma_gmacs']:.1f} GMAC/s, read {roof['read_gbs']:.1f} GB/s")
    report = {"level": caps.level, "threads": args.threads, "flags": flags, "peaks": roof,
              "peaks_before": before, "peaks_after": after,
              "kernels": [with_shares(row, roof) for row in kernels],
              "steps": [with_shares(row, roof) for row in served]}
    for row in report["kernels"]:
        print(f"{row['shape']:>5} rows {row['rows']:>3} {row['product']:<12} {row['ms']:8.2f} ms  "
              f"{row['gmacs']:6.1f} GMAC/s ({row['int8_share']:.2f} of int8)  "
              f"{row['gbs']:5.1f} GB/s ({row['read_share']:.2f} of read)")
    for row in report["steps"]:
        print(f"served decode step N={row['n']:>3}: {row['ms']:7.2f} ms  {row['gmacs']:6.1f} GMAC/s "
              f"({row['int8_share']:.2f} of int8), {row['gbs']:5.1f} GB/s ({row['read_share']:.2f} of read)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
