"""Low-bit against dense bfloat16 linear layers at the model's shapes.

    .venv/bin/python benchmarks/linear_kernels.py [--threads 2]

All four projections of 30 layers, each with its own weights as in the real model, so the
weights stream from memory instead of sitting in cache (with one layer's weights reused, as
an earlier version measured, int4 lost from 8 rows on). Prints milliseconds per pass over
all layers by batch rows for dense bf16 (F.linear, and weights prepacked for oneDNN: the
model's dense path without q4_q8_gemm), torch's int4 kernel, pagedllm's q4_gemm (exact) and
q4_q8_gemm (activations rounded to int8), with the ratios; these set Q4_EXACT_MAX_ROWS (where
the exact kernel gives way to q4_q8_gemm) and INT4_MAX_ROWS in pagedllm/models/quant_linear.py. Then the output head: prepacked bf16, torch's int8
kernel (INT8_MAX_ROWS) and pagedllm's q8_gemm.
"""
from __future__ import annotations


import torch

from pagedllm.backends import cpu_backend
from pagedllm.kernels import kernel_ops
from pagedllm.models.output_head import RefinedHead
from pagedllm.models.quant_linear import DenseLinear, Int8Linear
from pagedllm.weights.q4 import GROUP_SIZE
from pagedllm.weights.q8 import Q8Rows
from timing import ms_per_call, parse_args, smoke_or

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
NUM_LAYERS = 30


def make_layers(ops):
    layers = []
    for _ in range(smoke_or(NUM_LAYERS, 1)):
        for out, inp in SHAPES.values():
            codes = torch.randint(0, 16, (out, inp), dtype=torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            scales_zeros = (torch.rand(inp // GROUP_SIZE, out, 2) * 0.01).bfloat16().contiguous()
            dense = torch.randn(out, inp).bfloat16()
            q4 = ops.q4_pack(codes.to(torch.uint8), torch.rand(out, inp // GROUP_SIZE) * 0.01,
                             torch.rand(out, inp // GROUP_SIZE) * -0.1) if ops else None
            layers.append((dense, DenseLinear(dense, None, cpu_backend()), packed, scales_zeros, q4, inp))
    return layers


def time_pass(layers, rows: int, kind: str, repeat: int = 5) -> float:
    inputs = {inp: torch.randn(rows, inp).bfloat16() for inp in (576, 1536)}

    def one_pass():
        for dense, prepacked, packed, scales_zeros, q4, inp in layers:
            if kind == "q4_gemm":
                kernel_ops().q4_gemm(inputs[inp], q4)
            elif kind == "q4_q8_gemm":
                kernel_ops().q4_q8_gemm(inputs[inp], q4)
            elif kind == "int4":
                torch.ops.aten._weight_int4pack_mm_for_cpu(inputs[inp], packed, GROUP_SIZE, scales_zeros)
            elif kind == "prepacked":
                prepacked(inputs[inp])
            else:
                torch.nn.functional.linear(inputs[inp], dense)

    return ms_per_call(one_pass, repeat)


def main() -> None:
    args = parse_args()
    ops = kernel_ops()  # the level in use: PAGEDLLM_CPU_ISA picks a lower one
    layers = make_layers(ops)
    print(f"threads={args.threads}; ms per pass over the projections of "
          f"{smoke_or(NUM_LAYERS, 1)} layer(s)")
    print(f"{'rows':>5} {'bf16':>8} {'prepacked':>10} {'int4':>8} {'q4_gemm':>8} {'q4_q8':>8}"
          "  prepacked/int4  int4/q4_gemm  prepacked/q4_gemm  q4_gemm/q4_q8  prepacked/q4_q8")
    for rows in smoke_or((1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256), (1, 8)):
        dense_ms, prepacked_ms, int4_ms = (time_pass(layers, rows, kind)
                                           for kind in ("bf16", "prepacked", "int4"))
        q4_ms, q4_q8_ms = ((time_pass(layers, rows, kind) if ops else float("nan"))
                           for kind in ("q4_gemm", "q4_q8_gemm"))
        print(f"{rows:>5} {dense_ms:8.2f} {prepacked_ms:10.2f} {int4_ms:8.2f} {q4_ms:8.2f} {q4_q8_ms:8.2f}"
              f"  {prepacked_ms / int4_ms:13.2f}x {int4_ms / q4_ms:12.2f}x {prepacked_ms / q4_ms:17.2f}x"
              f" {q4_ms / q4_q8_ms:13.2f}x {prepacked_ms / q4_q8_ms:15.2f}x")
    # The output head (vocabulary x hidden): prepacked bf16, torch's int8 per-row kernel,
    # pagedllm's q8_gemm on Q8_0 codes. Four heads in turn, so they stream from memory.
    heads = []
    for _ in range(smoke_or(4, 1)):
        q8 = Q8Rows(torch.randint(-127, 128, (49152, 576), dtype=torch.int8),
                    (torch.rand(49152, 576 // GROUP_SIZE) * 0.01).half().float())
        heads.append((Int8Linear(q8.rows(torch.arange(49152)), cpu_backend()), ops.q8_pack(q8.codes, q8.scales) if ops else None, q8))
    print("output head 49152 x 576, ms per call")
    print(f"{'rows':>5} {'prepacked':>10} {'int8':>8} {'q8_gemm':>8}  prepacked/int8  prepacked/q8_gemm")
    for rows in smoke_or((1, 2, 4, 8, 16, 64), (1, 8)):
        x = torch.randn(rows, 576).bfloat16()
        per_head = 1 / len(heads)
        prepacked_ms = ms_per_call(lambda: [h.dense(x) for h, _, _ in heads]) * per_head
        int8_ms = ms_per_call(lambda: [torch.ops.aten._weight_int8pack_mm(x, h.codes, h.scales)
                                       for h, _, _ in heads]) * per_head
        q8_ms = (ms_per_call(lambda: [ops.q8_gemm(x, p) for _, p, _ in heads]) * per_head
                 if ops else float("nan"))
        print(f"{rows:>5} {prepacked_ms:10.2f} {int8_ms:8.2f} {q8_ms:8.2f}  {prepacked_ms / int8_ms:14.2f}x"
              f" {prepacked_ms / q8_ms:18.2f}x")
    if ops is None:
        return
    # The exact recomputation of each row's top 16 logits: torch (RefinedHead) against C++.
    print("top-16 exact recomputation, ms per call")
    print(f"{'rows':>5} {'torch':>8} {'C++':>8}  speed-up")
    _, packed, q8 = heads[0]
    for rows in (1, 8):
        x = torch.randn(rows, 576).bfloat16()
        logits = ops.q8_gemm(x, packed)
        torch_refine = RefinedHead(lambda _: logits.clone(), q8.rows, 16)
        torch_ms = ms_per_call(lambda: torch_refine(x), 200)
        cpp_ms = ms_per_call(lambda: ops.q8_refine_top(logits.clone(), x, q8.codes, q8.scales, 16), 200)
        print(f"{rows:>5} {torch_ms:8.3f} {cpp_ms:8.3f}  {torch_ms / cpp_ms:7.1f}x")


if __name__ == "__main__":
    main()
