"""4-bit GGUF weights (Q4_0, Q4_1, Q4_K) kept as codes + scales, as the file holds them.

Every such weight is w = code * d + m, code in 0..15, one (d, m) per 32 consecutive inputs:
Q4_1 stores d and m (float16), Q4_0 stores d with w = (code - 8) * d, i.e. m = -8d (Q4Weight).
Q4_K stores them in two levels, a 6-bit scale and min per 32 under a float16 d and dmin per
256 (Q4KWeight), which the kernels also take as they are (q4k_pack). pagedllm's q4_gemm takes
either; `torch_scales_zeros` gives the form torch's CPU int4 kernel takes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP_SIZE = 32
SUPER_GROUPS = 8  # Q4_K's groups of 32 under one d and dmin
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


@dataclass
class Q4Weight:
    codes: torch.Tensor  # [out, in] uint8 in 0..15
    d: torch.Tensor  # [out, in / 32] float32 (float16 values)
    m: torch.Tensor  # [out, in / 32] float32 (float16 values)

    def dequantize(self) -> torch.Tensor:
        out, cols = self.codes.shape
        groups = self.codes.float().view(out, cols // GROUP_SIZE, GROUP_SIZE)
        return (groups * self.d.unsqueeze(-1) + self.m.unsqueeze(-1)).view(out, cols)

    def torch_scales_zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) with w = (code - 8) * scale + zero: torch's int4 kernel's form."""
        return self.d, self.m + 8 * self.d

    def permute_rows(self, order: np.ndarray) -> Q4Weight:
        index = torch.from_numpy(order)
        return Q4Weight(self.codes[index], self.d[index], self.m[index])

    def kernel_pack(self, ops) -> torch.Tensor:
        """The tiles pagedllm's 4-bit kernels read."""
        return ops.q4_pack(self.codes, self.d, self.m)

    @staticmethod
    def cat(parts: list[Q4Weight]) -> Q4Weight:
        return Q4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]),
                        torch.cat([p.m for p in parts]))


@dataclass
class Q4KWeight:
    """Q4_K: w = (d * sc) * code - (dmin * mn), with sc, mn in 0..63 per 32 inputs and d,
    dmin (float16) per 256."""

    codes: torch.Tensor  # [out, in] uint8 in 0..15
    scales: torch.Tensor  # [out, in / 32] uint8 in 0..63
    mins: torch.Tensor  # [out, in / 32] uint8 in 0..63
    d: torch.Tensor  # [out, in / 256] float32 (float16 values)
    dmin: torch.Tensor  # [out, in / 256] float32 (float16 values)

    def per_group(self) -> Q4Weight:
        """The same weights as per-32 (d, m), exact in float32 (a float16 times a 6-bit
        integer), for the paths that take that form (torch's int4 kernel, a mixed cat)."""
        per = SUPER_GROUPS
        return Q4Weight(self.codes, self.d.repeat_interleave(per, 1) * self.scales.float(),
                        -(self.dmin.repeat_interleave(per, 1) * self.mins.float()))

    def dequantize(self) -> torch.Tensor:
        return self.per_group().dequantize()

    def torch_scales_zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.per_group().torch_scales_zeros()

    def permute_rows(self, order: np.ndarray) -> Q4KWeight:
        index = torch.from_numpy(order)
        return Q4KWeight(self.codes[index], self.scales[index], self.mins[index], self.d[index],
                         self.dmin[index])

    def kernel_pack(self, ops) -> torch.Tensor:
        return ops.q4k_pack(self.codes, self.scales, self.mins, self.d, self.dmin)

    @staticmethod
    def cat(parts: list[Q4KWeight]) -> Q4KWeight:
        return Q4KWeight(*(torch.cat([getattr(p, f) for p in parts])
                           for f in ("codes", "scales", "mins", "d", "dmin")))


def cat_4bit(parts: list) -> Q4Weight | Q4KWeight:
    """Matrices stacked by rows (a fused projection): Q4_K parts stay Q4_K; a mix of formats
    goes to per-32 (d, m)."""
    if all(isinstance(p, Q4KWeight) for p in parts):
        return Q4KWeight.cat(parts)
    return Q4Weight.cat([p.per_group() if isinstance(p, Q4KWeight) else p for p in parts])


def decode_q4(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Q4Weight:
    """raw: the tensor's bytes [rows, blocks * block_bytes] as stored in the GGUF file."""
    rows, cols = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // GROUP_SIZE, _BLOCK_BYTES[type_name])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
    else:
        qs = blocks[..., 2:]
        m = -8 * d  # exact: a power-of-two multiple of a float16
    # Low nibbles are the block's first 16 values, high nibbles the last 16.
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return Q4Weight(torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(d),
                    torch.from_numpy(np.ascontiguousarray(m)))


_Q4_K_BLOCK_BYTES = 144  # d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 of codes
_Q4_K_VALUES = 256


def decode_q4_k(raw: np.ndarray, shape: tuple[int, int]) -> Q4KWeight:
    """Q4_K: super-blocks of 256 values, 8 groups of 32, w = d * sc * code - dmin * mn with a
    6-bit scale sc and min mn per group, kept in that form."""
    from gguf.quants import Q4_K

    rows, cols = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, _Q4_K_BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # the gguf package's unpacking
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    # Each 32 bytes hold two groups: the low nibbles the first, the high nibbles the next.
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(rows, cols)
    groups, supers = cols // GROUP_SIZE, cols // _Q4_K_VALUES

    def tensor(array: np.ndarray, width: int, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array.reshape(rows, width).astype(dtype)))

    return Q4KWeight(torch.from_numpy(np.ascontiguousarray(codes)), tensor(sc, groups, np.uint8),
                     tensor(mn, groups, np.uint8), tensor(d, supers, np.float32),
                     tensor(dmin, supers, np.float32))
