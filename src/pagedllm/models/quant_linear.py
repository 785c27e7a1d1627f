"""Linear layers that multiply by 4-bit (QuantLinear), 6-bit (Q6Linear) or 8-bit (Q8Linear,
Int8Linear) weights, and a fused projection of parts in different formats (StackedLinear).

Decode steps with few tokens are bound by reading weights from memory, so 4-bit weights win
there. Large batches (prefill) are bound by arithmetic: there pagedllm's q4_q8_gemm rounds
the activations to int8 per group of 32 (per 256 inputs for Q4_K), as llama.cpp does
(its Q8_0 and Q8_K), and multiplies them as integers
(AVX512-VNNI, AVX2's vpmaddubsw, or plain C++ on the portable level) at about twice the rate
of float dot products. Every kernel level has both; only without the C++ kernels do layers
fall back to torch's int4 kernel and a dense copy. The crossovers were measured on this
machine (benchmarks/linear_kernels.py).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.backends import Backend
from pagedllm.weights.q4 import GROUP_SIZE, Q4KWeight, Q4Weight
from pagedllm.weights.q6 import Q6Weight
from pagedllm.weights.q8 import Q8Rows

# Per pass over the projections of 30 layers, weights streaming from memory
# (benchmarks/linear_kernels.py), ms:
#   rows                      1     8    16    64   128   256
#   q4_gemm (exact, bf16)   1.3   2.5   4.5  17.2  34.8  67.6
#   q4_q8_gemm (int8 acts)  1.5   2.3   3.5  12.1  23.1  44.7
#   dense bf16, prepacked   7.3   7.7   9.0  21.4  34.8  61.6
#   torch int4              2.5   6.2  11.4  41.6  82.5   163
# The exact kernel up to Q4_EXACT_MAX_ROWS[level], where the int8 one stops costing the same:
# on avx512 a decode step of up to 8 sequences keeps exact activations. At avx2 the exact
# product is the int16 tile (two vpmaddubsw a code where the int8 tile has one), at about
# two thirds of the int8 kernel's rate from 2 rows on and near it at one row, where both
# read near the memory floor on AMD's cores (benchmarks/roof.py), so only a single
# sequence's decode step stays exact there; the portable level's exact tile is float32
# throughout. A layer built without int8
# activations takes q4_gemm at every row count (0.91x dense at 256 rows, and no dense copy).
# Without the C++ kernels, torch's int4 kernel up to INT4_MAX_ROWS, dense above.
Q4_EXACT_MAX_ROWS = {"avx512": 8, "avx2": 1, "portable": 1}
# Except on these vendors' cores at these levels, where a single sequence's exact product is
# bound by the core rather than by memory: an Intel core at avx2 (three vector ports, two of
# them for vpmaddubsw, as on the pre-Ice-Lake Xeons that run this level) reads well below the
# memory's peak with the int16 tile's doubled products and a 1.7B decode step is faster with
# int8 rows, where AMD's cores read near the peak either way and gained nothing
# (docs/benchmarks/log.md, twenty-second and twenty-fourth sessions). Only layers that round
# activations at all are concerned: models from 1B parameters, not their edge layers.
Q4_EXACT_MAX_ROWS_BY_VENDOR = {("avx2", "GenuineIntel"): 0}


def q4_exact_max_rows(level: str, vendor: str) -> int:
    """The rows up to which a layer that rounds activations to int8 keeps them exact."""
    return Q4_EXACT_MAX_ROWS_BY_VENDOR.get((level, vendor), Q4_EXACT_MAX_ROWS[level])

# On a CPU with AMX tiles (kernels/cpu.py), a step of at least this many rows dequantizes the
# 4-bit (or Q8_0: Q8Linear) weight to bfloat16 (kernels/q4_dequant.cpp, into a buffer shared by the layers) and
# multiplies on the tiles through oneDNN: 1.5-2.7x the int8 kernel and 7x the exact one at 512
# rows, slower below ~128, where the dequantizing costs more than the tiles save
# (benchmarks/amx_prefill.py). The weights are then rounded to bfloat16, as a dense bfloat16
# layer's are.
AMX_MIN_ROWS = 128
# Below that, on the same CPUs, the exact 4-bit product runs on the tiles itself (the codes
# made bfloat16 128 + q, as the AVX-512 exact tile makes them: kernels/q4_tiles_amx.h) from
# AMX_EXACT_MIN_ROWS rows: at 8 rows 1.9-2x the AVX-512 exact tile, from 16 rows ahead of the
# int8 one too; even at 2 rows, slower at 1 (benchmarks/amx_prefill.py --rows). So on these
# CPUs every step below AMX_MIN_ROWS keeps exact activations.
AMX_EXACT_MIN_ROWS = 3
# From AMX_MIN_ROWS up to AMX_FUSED_MAX_ROWS, the 4-bit weight is rounded to bfloat16 tile by
# tile inside the product (kernels/q4_tiles_amx.h: q4_bf16_gemm), the same weights as the
# dequantized copy, without writing that copy: 1.6-3.4x dequantize + oneDNN at 128-164 rows,
# even at ~512, where oneDNN's blocking of the activations starts to win
# (benchmarks/amx_prefill.py --projections).
AMX_FUSED_MAX_ROWS = 512
INT4_MAX_ROWS = 8
ALL_ROWS = 1 << 62
# Where the CPU takes 4-bit products with 16-bit integer activations (kernels/cpu.py: every
# CPU at avx2, Intel at avx512), up to this many rows, by whether the AMX tiles are in use:
# q4_i16_gemm is 1.15x the exact tile at one row and 1.75x at 8 on Intel's avx512, 1.3-1.6x
# at avx2 (BENCHMARKS.md), so it replaces the exact tile at every row count (a row's result
# stays independent of the rows beside it), and it is ahead of the AMX tiles up to 4 rows
# (benchmarks/amx_prefill.py --rows).
INT16_MAX_ROWS = {False: ALL_ROWS, True: 4}
_TILE = 16  # the 4-bit kernels take output rows in tiles of 16


# Batch rows oneDNN is told to expect when it reorders a weight (a hint: any row count works).
PACK_ROWS_HINT = 256


class DenseLinear:
    """x @ W.T (+ b). bfloat16 weights are reordered once into oneDNN's blocked layout where
    the CPU level has bfloat16 arithmetic (avx512): bit-identical to F.linear and 5-25 % faster
    here from 17 to 300 rows (F.linear reorders on every call). Below that level oneDNN's
    bfloat16 path refuses to run (or emulates it slowly), so the weight is kept in float32 and
    bfloat16 inputs are multiplied in float32, the result rounded back. Other dtypes, or
    torch without oneDNN: plain F.linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 backend: Backend | None = None):
        """backend: where bfloat16 weights may be prepacked (None: plain F.linear)."""
        # detach: an autograd record on the packed copy would keep the original alive.
        weight = weight.detach()
        bf16 = weight.dtype == torch.bfloat16
        self.prepacked = bf16 and backend is not None and backend.prepacks_bfloat16
        self.widened = bf16 and not self.prepacked
        if self.widened:
            weight = weight.float()
            bias = None if bias is None else bias.float()
        self.bias = bias
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
                       if self.prepacked else weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.widened:
            return nn.functional.linear(x.float(), self.weight, self.bias).to(x.dtype)
        return nn.functional.linear(x, self.weight, self.bias)


class QuantLinear(nn.Module):
    """x @ W.T (+ b) for a 4-bit GGUF weight in a bfloat16 model. With the C++ kernels (any
    level): exactly (q4_gemm) up to exact_max_rows, with int8-rounded activations
    (q4_q8_gemm) above, unless int8_activations is off; no dense copy. Within the exact
    range, up to int16_max_rows rows take 16-bit integer activations (q4_i16_gemm) where the
    CPU prefers them (kernels/cpu.py), and from amx_exact_min_rows the AMX tiles. Without them: torch's
    int4 kernel up to INT4_MAX_ROWS rows, a dense copy beyond. dense_weight None: the layer
    is bfloat16, and a dense copy, where one is needed, is made from the codes."""

    def __init__(self, dense_weight: torch.Tensor | None, bias: torch.Tensor | None,
                 q4: Q4Weight | Q4KWeight, backend: Backend, int8_activations: bool = True):
        super().__init__()
        dtype = torch.bfloat16 if dense_weight is None else dense_weight.dtype
        self.bias = bias
        self.dense = None
        # Both kernels take output rows in tiles of 16; other shapes run dense.
        tileable = q4.codes.shape[0] % _TILE == 0
        self.q4_ops = backend.kernels if dtype == torch.bfloat16 and tileable else None
        if self.q4_ops is not None:
            self.packed = q4.kernel_pack(self.q4_ops)
            self.max_rows = ALL_ROWS
            self.exact_max_rows = (q4_exact_max_rows(self.q4_ops.isa(), backend.cpu.vendor)
                                   if int8_activations else ALL_ROWS)
        elif backend.torch_ops.int4_matmul and tileable:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.codes.to(torch.int32), 1)
            # The kernel takes [in / 32, out, 2] (scale, zero) in the activation dtype.
            scales, zeros = q4.torch_scales_zeros()
            self.scales_zeros = torch.stack([scales.T, zeros.T], dim=-1).to(dtype).contiguous()
            self.exact_max_rows = self.max_rows = INT4_MAX_ROWS
        else:
            self.exact_max_rows = self.max_rows = 0  # dense only
        self.amx_min_rows = self.amx_exact_min_rows = ALL_ROWS
        self.int16_max_rows = 0
        if self.q4_ops is not None and backend.cpu.int16:
            self.int16_max_rows = INT16_MAX_ROWS[backend.cpu.amx]
        if self.q4_ops is not None and backend.cpu.amx:
            self.amx_min_rows, self.scratch = AMX_MIN_ROWS, backend.scratch
            self.amx_exact_min_rows = max(AMX_EXACT_MIN_ROWS, self.int16_max_rows + 1)
            self.exact_max_rows = ALL_ROWS
            self.fan_in = q4.codes.shape[1]
        if self.max_rows < ALL_ROWS:  # [out, in] model dtype, for large batches
            self.dense = DenseLinear(q4.dequantize().to(dtype) if dense_weight is None else dense_weight,
                                     bias, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return self.dense(x)
        if x.shape[0] >= self.amx_min_rows:
            out = self._on_amx_tiles(x)
        elif self.q4_ops is not None:
            out = self.q4_ops.q4_linear(x, self.packed, self.exact_max_rows, self.amx_exact_min_rows,
                                        self.int16_max_rows)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_zeros)
        return out if self.bias is None else out + self.bias


    def _on_amx_tiles(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= AMX_FUSED_MAX_ROWS:
            return self.q4_ops.q4_bf16_gemm(x, self.packed)
        return on_amx_tiles(x, self.q4_ops, self.packed, self.fan_in, self.scratch)


def on_amx_tiles(x: torch.Tensor, ops, packed: torch.Tensor, fan_in: int,
                 scratch: dict) -> torch.Tensor:
    """x @ W.T for a packed 4-bit or Q8_0 weight: dequantized to bfloat16 into the buffer
    of its shape (shared by the layers), then multiplied by oneDNN on the AMX tiles."""
    shape = (fan_in, packed.shape[0] * _TILE)
    buffer = scratch.get(shape)
    if buffer is None:
        buffer = scratch[shape] = torch.empty(shape, dtype=torch.bfloat16)
    return torch.matmul(x, ops.lowbit_dequantize(packed, fan_in, buffer))


class Int8ActivationLinear(nn.Module):
    """x @ W.T (+ b) through a kernel that rounds the activations to int8 per group of 32 at
    every row count, as llama.cpp multiplies these formats (float32 out); no dense copy.
    From AMX_MIN_ROWS rows, where the backend has the AMX tiles: amx (kernels, fan_in, scratch)
    dequantizes for oneDNN (Q8_0); tiles_gemm multiplies on the tiles with the weight rounded
    to bfloat16 inside the kernel (Q6_K: q6_bf16_gemm)."""

    def __init__(self, packed: torch.Tensor, gemm, bias: torch.Tensor | None, amx=None,
                 tiles_gemm=None):
        super().__init__()
        self.packed, self.gemm, self.bias, self.amx = packed, gemm, bias, amx
        self.tiles_gemm = tiles_gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x16 = x.to(torch.bfloat16).contiguous()
        if self.tiles_gemm is not None and x.shape[0] >= AMX_MIN_ROWS:
            out = self.tiles_gemm(x16, self.packed).to(x.dtype)
        elif self.amx is not None and x.shape[0] >= AMX_MIN_ROWS:
            out = on_amx_tiles(x16, self.amx[0], self.packed, self.amx[1], self.amx[2]).to(x.dtype)
        else:
            out = self.gemm(x16, self.packed).to(x.dtype)
        return out if self.bias is None else out + self.bias


class Q8Linear(Int8ActivationLinear):
    """An 8-bit weight (GGUF Q8_0, or Q5_* / i-quants rounded to it) through q8_gemm; on the
    AMX tiles for many rows where the backend has them."""

    def __init__(self, q8: Q8Rows, bias: torch.Tensor | None, ops, backend: Backend | None = None):
        amx = None
        if backend is not None and backend.cpu.amx and q8.codes.shape[0] % _TILE == 0:
            amx = (ops, q8.codes.shape[1], backend.scratch)
        super().__init__(ops.q8_pack(q8.codes, q8.scales), ops.q8_gemm, bias, amx)


class Q6Linear(Int8ActivationLinear):
    """A GGUF Q6_K weight as the file holds it through q6_gemm: 6.56 bits a weight read per
    token instead of the 8.5 of Q8_0. On the AMX tiles for many rows where the backend has
    them (the weight rounded to bfloat16 there, as a dequantized copy would be)."""

    def __init__(self, q6: Q6Weight, bias: torch.Tensor | None, ops, backend: Backend | None = None):
        tiles = ops.q6_bf16_gemm if backend is not None and backend.cpu.amx else None
        super().__init__(ops.q6_pack(q6.codes, q6.scales, q6.d), ops.q6_gemm, bias, tiles_gemm=tiles)


class StackedLinear(nn.Module):
    """One fused projection whose parts are stored in different formats (a Q4_K_M file's
    q and k 4-bit next to a 6-bit v): each part's own kernel, outputs side by side."""

    def __init__(self, parts: list, bias: torch.Tensor | None):
        super().__init__()
        self.parts, self.bias = parts, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias


# Rows up to which the int8 output head (the fallback without the C++ kernels) beats dense
# bfloat16 prepacked for oneDNN here (49152 x 576: 1 row 0.95 vs 1.28 ms, 4 rows 1.01 vs 1.23,
# 8 rows 1.96 vs 1.42; benchmarks/linear_kernels.py).
INT8_MAX_ROWS = 4


class Int8Linear(nn.Module):
    """Weight-only int8 (one symmetric scale per output row) for a few rows, dense bfloat16
    beyond. Used for the output head, where 4-bit codes blurred the logits of the whole
    vocabulary (mean error against float32 0.47 vs 0.13, one ad-hoc comparison on the
    default model) but 8 bits do not (0.14, tests/test_real_model.py)."""

    def __init__(self, weight: torch.Tensor, backend: Backend, max_int8_rows: int = INT8_MAX_ROWS):
        super().__init__()
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
        self.codes = (w / scales.unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)
        self.scales = scales.to(torch.bfloat16)
        self.dense = DenseLinear(w.to(torch.bfloat16), None, backend)
        self.max_int8_rows = max_int8_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_int8_rows:
            return self.dense(x)
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)
