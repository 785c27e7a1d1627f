"""A GGUF Q6_K matrix kept as the file holds it: 6-bit codes, an int8 scale per 16 inputs and
a float16 d per 256, w = d * sc * (code - 32). The 6-bit kernel (q6_gemm) reads this form, a
quarter fewer bytes than the Q8_0 these weights would otherwise be rounded to.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SCALE_GROUP = 16  # inputs per int8 scale
SUPER_BLOCK = 256  # inputs per d
_BLOCK_BYTES = 210  # ql (128), qh (64), scales (16), d (2)


@dataclass
class Q6Weight:
    codes: torch.Tensor  # [out, in] uint8 in 0..63
    scales: torch.Tensor  # [out, in / 16] int8
    d: torch.Tensor  # [out, in / 256] float32 (float16 values)

    def dequantize(self) -> torch.Tensor:
        out, cols = self.codes.shape
        step = self.d.repeat_interleave(SUPER_BLOCK // SCALE_GROUP, 1) * self.scales.float()
        groups = (self.codes.float() - 32).view(out, cols // SCALE_GROUP, SCALE_GROUP)
        return (groups * step.unsqueeze(-1)).view(out, cols)

    def permute_rows(self, order: np.ndarray) -> Q6Weight:
        index = torch.from_numpy(order)
        return Q6Weight(self.codes[index], self.scales[index], self.d[index])

    @staticmethod
    def cat(parts: list[Q6Weight]) -> Q6Weight:
        return Q6Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                        torch.cat([p.d for p in parts]))


def decode_q6_k(raw: np.ndarray, shape: tuple[int, int]) -> Q6Weight:
    """raw: the tensor's bytes as stored in the GGUF file; shape: (rows, cols). Each block's
    two halves of 128 values hold their low 4 bits in 64 bytes (values 0-31 and 64-95 in the
    low and high nibbles of bytes 0-31, 32-63 and 96-127 in those of bytes 32-63) and their
    high 2 bits in 32 bytes (value l + 32t at bits 2t of byte l)."""
    rows, cols = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, _BLOCK_BYTES)
    ql = blocks[:, :128].reshape(-1, 2, 64)
    qh = blocks[:, 128:192].reshape(-1, 2, 32)
    low = np.concatenate([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4],
                         axis=-1)
    high = np.concatenate([(qh >> shift) & 0x03 for shift in (0, 2, 4, 6)], axis=-1)
    codes = (low | (high << 4)).reshape(rows, cols)
    scales = blocks[:, 192:208].copy().view(np.int8).reshape(rows, cols // SCALE_GROUP)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32).reshape(rows, cols // SUPER_BLOCK)
    return Q6Weight(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(scales),
                    torch.from_numpy(d))
