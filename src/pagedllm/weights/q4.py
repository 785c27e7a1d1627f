"""4-bit GGUF weights (Q4_0, Q4_1) kept as codes + per-32 scales and offsets, as the file holds them.

Every such weight is w = code * d + m, code in 0..15, one (d, m) per 32 consecutive inputs:
Q4_1 stores d and m (float16), Q4_0 stores d with w = (code - 8) * d, i.e. m = -8d. pagedllm's
q4_gemm takes this form; `torch_scales_zeros` gives the one torch's CPU int4 kernel takes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP_SIZE = 32
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

    @staticmethod
    def cat(parts: list[Q4Weight]) -> Q4Weight:
        return Q4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]),
                        torch.cat([p.m for p in parts]))


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


def decode_q4_k(raw: np.ndarray, shape: tuple[int, int]) -> Q4Weight:
    """Q4_K: super-blocks of 256 values, 8 groups of 32, w = d * sc * code - dmin * mn with a
    6-bit scale sc and min mn per group. Per group that is the Q4 form, d' = d * sc and
    m' = -dmin * mn, both exact in float32 (a float16 times a 6-bit integer). The kernels
    store d' and m' as float16 (q4_pack), rounding them by at most 2^-11 relative."""
    from gguf.quants import Q4_K

    rows, cols = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, _Q4_K_BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # the gguf package's unpacking
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)
    # Each 32 bytes hold two groups: the low nibbles the first, the high nibbles the next.
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(rows, cols)
    groups = cols // GROUP_SIZE
    return Q4Weight(torch.from_numpy(np.ascontiguousarray(codes)),
                    torch.from_numpy((d * sc.astype(np.float32)).reshape(rows, groups)),
                    torch.from_numpy((-(dmin * mn.astype(np.float32))).reshape(rows, groups)))
