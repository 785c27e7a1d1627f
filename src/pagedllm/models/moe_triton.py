"""A mixture of experts' small steps on a GPU without the host (moe.py): each (token, chosen
expert) pair's product with that expert's matrix, read where it lies in the stacked expert
weights by an index on the device. moe.py's grouped path counts each expert's tokens on the
host to size its GEMMs, a sync that no CUDA graph can capture, and launches a few kernels an
expert; this is one launch for all pairs, and a decode step of a mixture of experts can be
replayed as a graph.

It reads one expert matrix a pair, so it is used while the pairs are no more than the
experts (moe.py: `device_pairs`): then it reads at most as many matrices as the grouped
path could. On the CPU it runs under Triton's interpreter (tests/test_moe_triton.py), which
is how CI checks it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _expert_gemv(x_ptr, w_ptr, experts_ptr, out_ptr, N, K, stride_x, stride_we, stride_wn,
                 stride_o, X_ROW_PER: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Program (pair, block of outputs): out[pair] = w[expert of pair] @ x[pair // X_ROW_PER],
    accumulated in float32."""
    pair = tl.program_id(0)
    expert = tl.load(experts_ptr + pair).to(tl.int64)
    row = pair // X_ROW_PER
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + row * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + expert * stride_we + n[:, None] * stride_wn + k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + pair * stride_o + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def expert_gemv(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                rows_per_input: int) -> torch.Tensor:
    """x [R, K]; weights [E, N, K] (each expert's matrix, rows its outputs); experts [P]
    (the expert of each pair). Pair p multiplies x[p // rows_per_input] (rows_per_input:
    the experts a token chose, where x holds tokens; 1 where x holds a row a pair).
    Returns [P, N] in x's dtype."""
    num_pairs, (num_out, depth) = experts.shape[0], weights.shape[1:]
    if x.stride(-1) != 1 or weights.stride(-1) != 1 or weights.stride(1) != depth:
        raise ValueError("expert_gemv: x's rows and each expert's rows must be contiguous")
    out = torch.empty(num_pairs, num_out, dtype=x.dtype, device=x.device)
    if num_pairs:
        _expert_gemv[(num_pairs, triton.cdiv(num_out, BLOCK_N))](
            x, weights, experts, out, num_out, depth, x.stride(0), weights.stride(0),
            weights.stride(1), out.stride(0), X_ROW_PER=rows_per_input, BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K)
    return out
