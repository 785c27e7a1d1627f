"""The adapters' products of a step on a GPU, as the C++ kernel does them on the CPU
(kernels/lora_sgmv.cpp): two Triton kernels, shrink (h = A[slot] @ x per token, every part's
rows) and expand (y += h's part @ B[slot] per output column block), each one launch over the
whole step whatever the number of adapters (Punica's BGMV). The layout is the slots'
(grouped.py). CI runs them under Triton's interpreter (tests/test_lora_model.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS, BLOCK_K, BLOCK_N = 16, 64, 64


@triton.jit
def _shrink(x_ptr, a_ptr, slots_ptr, scales_ptr, h_ptr, K, ROWS,
            BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    slot = tl.load(slots_ptr + t)
    safe = tl.maximum(slot, 0)
    # (the slot broadcast to a block before comparing: masks are blocks of booleans)
    row_ok = (rows < ROWS) & ((rows * 0 + slot) >= 0)
    acc = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (k < K) & ((k * 0 + slot) >= 0)
        x = tl.load(x_ptr + t * K + k, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + (safe * ROWS + rows[:, None]) * K + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    scale = tl.load(scales_ptr + t)
    tl.store(h_ptr + t * ROWS + rows, acc * scale, mask=rows < ROWS)


@triton.jit
def _expand(y_ptr, h_ptr, b_ptr, slots_ptr, N, RANK, ROWS, START1, START2,
            BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t)
    safe = tl.maximum(slot, 0)
    col_ok = (cols < N) & ((cols * 0 + slot) >= 0)
    part = (cols >= START1).to(tl.int32) + (cols >= START2).to(tl.int32)  # at most 3 parts
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r in range(0, RANK):
        h = tl.load(h_ptr + t * ROWS + part * RANK + r, mask=col_ok, other=0.0)
        b = tl.load(b_ptr + (safe * RANK + r) * N + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += h * b
    y = tl.load(y_ptr + t * N + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * N + cols, (y + acc).to(y_ptr.dtype.element_ty), mask=col_ok)


class TritonLoRA:
    """lora_add with the C++ kernel's signature (grouped.py calls either)."""

    @staticmethod
    def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 slots: torch.Tensor, scales: torch.Tensor, part_starts: list[int]) -> None:
        tokens, fan_in = x.shape
        rows, rank, fan_out = a.shape[1], b.shape[1], y.shape[1]
        if len(part_starts) > 4:
            raise ValueError("the Triton LoRA kernel takes at most 3 parts a projection")
        starts = list(part_starts[1:-1]) + [fan_out] * (3 - len(part_starts) + 1)
        h = torch.empty(tokens, rows, dtype=torch.float32, device=x.device)
        _shrink[(tokens, triton.cdiv(rows, BLOCK_ROWS))](
            x, a, slots, scales, h, fan_in, rows, BLOCK_ROWS=BLOCK_ROWS, BLOCK_K=BLOCK_K)
        _expand[(tokens, triton.cdiv(fan_out, BLOCK_N))](
            y, h, b, slots, fan_out, rank, rows, starts[0], starts[1], BLOCK_N=BLOCK_N)
