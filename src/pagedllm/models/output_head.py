"""The model's two ends: the token embedding, and the output head. A float32 model's head is
the exact product (ExactHead); the bfloat16 model's gives float32 logits from a fast product
over the vocabulary,
with each row's top candidates recomputed exactly (rounded logits alone flip greedy choices
on the default model).

Two shapes of the same contract, `head(hidden [N, H]) -> [N, vocab] float32`:
- `Q8Head`: the GGUF Q8_0 codes through q8_gemm (activations rounded to int8 per group of
  32, as llama.cpp does), then q8_refine_top, both C++. Faster than dense bfloat16 at every
  row count measured (49152 x 576: 1 row 0.57 vs 1.26 ms, 8 rows 0.72 vs 1.50, 64 rows 3.3
  vs 4.8; benchmarks/linear_kernels.py), so no other copy of the head is kept. A Q6_K head
  (a Q4_K_M file's) is multiplied in its own 6-bit layout (q6_gemm, a quarter fewer bytes
  read a token) and refined from its Q8_0 rounding, the rows the embedding reads.
- `RefinedHead`: without the C++ kernels, or where the head is not Q8_0: int8 per-row codes
  (Int8Linear) or dense bfloat16, then torch's topk and an exact product over those rows.
"""
from __future__ import annotations

from typing import Callable

import torch

from pagedllm.backends import Backend
from pagedllm.models.quant_linear import DenseLinear, Int8Linear
from pagedllm.weights.q6 import Q6Weight
from pagedllm.weights.q8 import Q8Rows

TILE = 16  # q8_gemm packs output rows in tiles of 16


class TokenEmbedding:
    """Rows of the embedding, exact: float32, or a GGUF's 8-bit codes read back row by row
    (bf16 rows would move the logits). Gemma scales them by sqrt(hidden), rounded to the
    model's dtype first, as its reference does."""

    def __init__(self, weight: torch.Tensor | None, q8: Q8Rows | None, scale: float | None = None):
        self.weight, self.q8, self.scale = weight, q8, scale

    def to_device(self, device: str) -> None:
        if self.q8 is not None:
            raise ValueError("8-bit embedding rows are read on the CPU only")
        self.weight = self.weight.to(device)

    def __call__(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = self.q8.rows(index) if self.q8 is not None else self.weight[index]
        hidden = rows.to(dtype)
        if self.scale is not None:
            hidden = hidden * torch.tensor(self.scale, dtype=dtype)
        return hidden


class ExactHead:
    """float32 logits, exactly: the float32 model's head."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def to_device(self, device: str, tied_to: torch.Tensor | None = None) -> None:
        """tied_to: the embedding's matrix, already there, when the head is that matrix."""
        self.weight = tied_to if tied_to is not None else self.weight.to(device)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float() @ self.weight.T


class DeviceHead(ExactHead):
    """The bfloat16 model's head on the generic backend (a GPU's): the product over the
    vocabulary in bfloat16 (half the bytes of float32, and a bfloat16 GEMM where float32 ran
    a slower one), then each row's top candidates recomputed exactly from the float32 rows,
    as RefinedHead does on the CPU: rounded logits alone flip greedy choices. float32 logits
    come out, for the sampler."""

    def __init__(self, weight: torch.Tensor, top: int):
        super().__init__(weight)
        self.rounded = weight.to(torch.bfloat16)
        self.top = top

    def to_device(self, device: str, tied_to: torch.Tensor | None = None) -> None:
        super().to_device(device, tied_to)
        self.rounded = self.rounded.to(device)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = (hidden.to(torch.bfloat16) @ self.rounded.T).float()
        top = logits.topk(min(self.top, logits.shape[1]), dim=-1).indices  # [N, k]
        exact = torch.einsum("nh,nkh->nk", hidden.float(), self.weight[top])
        return logits.scatter_(1, top, exact)


class Q8Head:
    def __init__(self, q8: Q8Rows, ops, top: int, q6: Q6Weight | None = None):
        self.q8, self.ops, self.top = q8, ops, top
        if q6 is None:
            self.packed, self.gemm = ops.q8_pack(q8.codes, q8.scales), ops.q8_gemm
        else:
            self.packed, self.gemm = ops.q6_pack(q6.codes, q6.scales, q6.d), ops.q6_gemm

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.to(torch.bfloat16)
        logits = self.gemm(x, self.packed)
        return self.ops.q8_refine_top(logits, x, self.q8.codes, self.q8.scales, self.top)


class RefinedHead:
    def __init__(self, approx, exact_rows: Callable[[torch.Tensor], torch.Tensor], top: int):
        self.approx, self.exact_rows, self.top = approx, exact_rows, top

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.approx(hidden.to(torch.bfloat16)).float()
        top = logits.topk(self.top, dim=-1).indices  # [N, k]
        exact = torch.einsum("nh,nkh->nk", hidden.float(), self.exact_rows(top))
        return logits.scatter_(1, top, exact)


def output_head(weight: torch.Tensor, q8: Q8Rows | None, top: int, backend: Backend,
                q6: Q6Weight | None = None):
    """Q8Head where the head has Q8_0 codes (and, for a Q6_K head, its 6-bit codes q6) and the
    C++ kernels load, else RefinedHead over int8 per-row codes (or dense bfloat16), its exact
    rows read from the Q8_0 codes or the weight."""
    ops = backend.kernels  # every CPU level's build has q8_gemm and q6_gemm
    if isinstance(q8, Q8Rows) and ops is not None and q8.codes.shape[0] % TILE == 0:
        return Q8Head(q8, ops, top, q6)
    approx = (Int8Linear(weight, backend) if backend.torch_ops.int8_matmul
              else DenseLinear(weight.to(torch.bfloat16), None, backend))
    exact_rows = q8.rows if isinstance(q8, Q8Rows) else (lambda index: weight[index])
    return RefinedHead(approx, exact_rows, top)
