"""4-bit GGUF matrices kept 4-bit on the generic backend's device (`--gpu-4bit`, issue 32):
a decode step reads a quarter of the bytes the bf16 copy would.

The weights are the file's (Q4_0, Q4_1, Q4_K as per-32 (d, m): weights/q4.py): w = code * d
+ m, codes packed two to a byte (even input in the low nibble, odd in the high), d and m in
float32 per 32 inputs (exact: a float16 times a 6-bit integer). Steps of up to GEMV_MAX_ROWS
rows (decode) run one Triton kernel that unpacks each tile in registers and multiplies it
with every row (CUDA cores: at a few rows the step reads weights, it does not compute);
larger steps (prefill) run a matrix-product kernel that unpacks each [K, N] tile of codes in
registers, in the activations' dtype, and multiplies it on the tensor cores (Marlin's idea:
each code read once a row tile, no dequantized copy of the matrix). Both run on the CPU too,
under Triton's interpreter, which is how CI tests them (tests/test_int4_triton.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.weights.q4 import GROUP_SIZE, Q4KWeight, Q4Weight

GEMV_MAX_ROWS = 8  # above: the tensor-core product (_int4_matmul)
BLOCK_N = 64
BLOCK_K = 64  # inputs a tile covers: two groups of 32
# The GEMV's outputs a program: few, so that a decode step's matrices fill the card with
# programs (a 2048-output matrix in tiles of 64 ran 32 programs on an H200's 132 SMs, one
# reason its 4-bit decode was 3x slower than dense); each program reads 64 bytes of codes a
# row per step of GEMV_BLOCK_K inputs. Chosen by that count, not yet timed on a GPU.
GEMV_BLOCK_N = 16
GEMV_BLOCK_K = 128


@triton.jit
def _weight_tiles(packed_ptr, d_ptr, m_ptr, n, n_ok, even, k_ok, stride_pn, stride_dn,
                  GROUP: tl.constexpr):
    """The weights at the even inputs `even` and the odd ones after them, of the outputs n:
    two [len(even), len(n)] float32 tiles, code * d + m (0 where masked)."""
    tile_ok = k_ok[:, None] & n_ok[None, :]
    byte = tl.load(packed_ptr + n[None, :] * stride_pn + (even // 2)[:, None],
                   mask=tile_ok, other=0).to(tl.int32)
    group = (even // GROUP)[:, None]
    d = tl.load(d_ptr + n[None, :] * stride_dn + group, mask=tile_ok, other=0.0)
    m = tl.load(m_ptr + n[None, :] * stride_dn + group, mask=tile_ok, other=0.0)
    return (byte & 15).to(tl.float32) * d + m, (byte >> 4).to(tl.float32) * d + m


@triton.jit
def _int4_gemv(x_ptr, packed_ptr, d_ptr, m_ptr, out_ptr, M, N, K,
               stride_xm, stride_pn, stride_dn, stride_om,
               ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = tl.arange(0, ROWS)
    row_ok = rows < M
    half = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        even = k0 + 2 * half  # [BLOCK_K/2] the even inputs of the tile; odd = even + 1
        k_ok = even < K
        w_even, w_odd = _weight_tiles(packed_ptr, d_ptr, m_ptr, n, n_ok, even, k_ok, stride_pn,
                                      stride_dn, GROUP)
        x_ok = row_ok[:, None] & k_ok[None, :]
        x_even = tl.load(x_ptr + rows[:, None] * stride_xm + even[None, :], mask=x_ok,
                         other=0.0).to(tl.float32)  # [ROWS, BLOCK_K/2]
        x_odd = tl.load(x_ptr + rows[:, None] * stride_xm + (even + 1)[None, :], mask=x_ok,
                        other=0.0).to(tl.float32)
        acc += tl.sum(x_even[:, :, None] * w_even[None, :, :]
                      + x_odd[:, :, None] * w_odd[None, :, :], axis=1)
    tl.store(out_ptr + rows[:, None] * stride_om + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _int4_matmul(x_ptr, packed_ptr, d_ptr, m_ptr, out_ptr, M, N, K,
                 stride_xm, stride_pn, stride_dn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Program (output tile, row tile): x [BLOCK_M rows] @ W.T [BLOCK_N outputs], W's codes
    unpacked a [BLOCK_K, BLOCK_N] tile at a time into the activations' dtype (as dequantize()
    rounds them), the even and the odd inputs as two products. UPCAST: float32 operands
    (Triton's interpreter multiplies bfloat16 operands' bits, not their values)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    half = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        even = k0 + 2 * half
        k_ok = even < K
        w_even, w_odd = _weight_tiles(packed_ptr, d_ptr, m_ptr, n, n_ok, even, k_ok, stride_pn,
                                      stride_dn, GROUP)
        x_ok = row_ok[:, None] & k_ok[None, :]
        x_even = tl.load(x_ptr + rows[:, None] * stride_xm + even[None, :], mask=x_ok, other=0.0)
        x_odd = tl.load(x_ptr + rows[:, None] * stride_xm + (even + 1)[None, :], mask=x_ok,
                        other=0.0)
        w_even, w_odd = w_even.to(x_even.dtype), w_odd.to(x_even.dtype)
        if UPCAST:
            x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
            w_even, w_odd = w_even.to(tl.float32), w_odd.to(tl.float32)
        if IEEE:
            acc += tl.dot(x_even, w_even, input_precision="ieee")
            acc += tl.dot(x_odd, w_odd, input_precision="ieee")
        else:
            acc += tl.dot(x_even, w_even)
            acc += tl.dot(x_odd, w_odd)
    tl.store(out_ptr + rows[:, None] * stride_om + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def row_tile(rows: int) -> int:
    """The product kernel's rows a program: the tensor cores' least 16, up to 64."""
    return min(64, max(16, triton.next_power_of_2(rows)))


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes 0..15 -> [out, in / 2] bytes: even input low nibble, odd high."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


class Int4Linear(torch.nn.Module):
    """y = x @ W.T (+ bias) with W kept as the file's 4-bit codes and per-32 (d, m)."""

    def __init__(self, weight: Q4Weight | Q4KWeight, bias: torch.Tensor | None = None):
        super().__init__()
        weight = weight.per_group() if isinstance(weight, Q4KWeight) else weight
        self.out_features, self.in_features = weight.codes.shape
        if self.in_features % GROUP_SIZE:
            raise ValueError(f"4-bit rows of {self.in_features} inputs: not whole groups of 32")
        self.register_buffer("packed", pack_codes(weight.codes.to(torch.uint8)))
        self.register_buffer("d", weight.d.float().contiguous())
        self.register_buffer("m", weight.m.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        codes = torch.stack([self.packed & 15, self.packed >> 4], dim=-1).view(
            self.out_features, self.in_features // GROUP_SIZE, GROUP_SIZE)
        weight = codes.float() * self.d.unsqueeze(-1) + self.m.unsqueeze(-1)
        return weight.view(self.out_features, self.in_features).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        if rows.shape[0] > GEMV_MAX_ROWS:
            tile = row_tile(rows.shape[0])
            grid = (triton.cdiv(self.out_features, BLOCK_N), triton.cdiv(rows.shape[0], tile))
            _int4_matmul[grid](rows, self.packed, self.d, self.m, out, rows.shape[0],
                               self.out_features, self.in_features, rows.stride(0),
                               self.packed.stride(0), self.d.stride(0), out.stride(0),
                               BLOCK_M=tile, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP=GROUP_SIZE,
                               IEEE=x.dtype == torch.float32, UPCAST=x.device.type != "cuda")
        elif rows.shape[0] > 0:
            grid = (triton.cdiv(self.out_features, GEMV_BLOCK_N),)
            _int4_gemv[grid](rows, self.packed, self.d, self.m, out, rows.shape[0],
                             self.out_features, self.in_features, rows.stride(0),
                             self.packed.stride(0), self.d.stride(0), out.stride(0),
                             ROWS=max(1, triton.next_power_of_2(rows.shape[0])),
                             BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K, GROUP=GROUP_SIZE)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)
