"""A linear layer that multiplies by 4-bit weights for small batches.

Decode steps with few tokens are bound by reading weights from memory, so torch's CPU int4
kernel (weights 4-bit, activations bfloat16, group size 32) wins there; large batches
(prefill) are bound by arithmetic, where the dense bfloat16 GEMM is faster. Both copies are
kept; the crossover was measured on this machine (benchmarks/linear_kernels.py).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.weights.q4 import GROUP_SIZE, Q4Weight

# Rows (tokens) up to which the int4 kernel beats dense bf16 here.
INT4_MAX_ROWS = 16


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class QuantLinear(nn.Module):
    def __init__(self, dense: nn.Linear, q4: Q4Weight, max_int4_rows: int = INT4_MAX_ROWS):
        super().__init__()
        dtype = dense.weight.dtype
        self.dense_weight = dense.weight  # [out, in] in the model dtype, for large batches
        self.bias = dense.bias
        self.out_features = q4.codes.shape[0]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.codes.to(torch.int32), 1)
        # The kernel takes [in / 32, out, 2] (scale, zero) in the activation dtype.
        self.scales_zeros = torch.stack([q4.scales.T, q4.zeros.T], dim=-1).to(dtype).contiguous()
        self.max_int4_rows = max_int4_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_int4_rows:
            return nn.functional.linear(x, self.dense_weight, self.bias)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_zeros)
        return out if self.bias is None else out + self.bias
