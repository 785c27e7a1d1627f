"""4-bit GGUF weights (Q4_0, Q4_1) kept as codes + per-32 scales and zeros.

Every such weight is w = (code - 8) * scale + zero, code in 0..15, one (scale, zero) per 32
consecutive inputs: Q4_0 has zero = 0, Q4_1 (w = q * d + m) has zero = m + 8d. This is the
form torch's CPU int4 kernel takes, so the model can multiply by the 4-bit weights directly.
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
    scales: torch.Tensor  # [out, in / 32] float32
    zeros: torch.Tensor  # [out, in / 32] float32

    def dequantize(self) -> torch.Tensor:
        out, cols = self.codes.shape
        groups = (self.codes.float() - 8).view(out, cols // GROUP_SIZE, GROUP_SIZE)
        return (groups * self.scales.unsqueeze(-1) + self.zeros.unsqueeze(-1)).view(out, cols)

    def permute_rows(self, order: np.ndarray) -> Q4Weight:
        index = torch.from_numpy(order)
        return Q4Weight(self.codes[index], self.scales[index], self.zeros[index])

    @staticmethod
    def cat(parts: list[Q4Weight]) -> Q4Weight:
        return Q4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                        torch.cat([p.zeros for p in parts]))


def decode_q4(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Q4Weight:
    """raw: the tensor's bytes [rows, blocks * block_bytes] as stored in the GGUF file."""
    rows, cols = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // GROUP_SIZE, _BLOCK_BYTES[type_name])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
        zeros = m + 8 * d
    else:
        qs = blocks[..., 2:]
        zeros = np.zeros_like(d)
    # Low nibbles are the block's first 16 values, high nibbles the last 16.
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    return Q4Weight(torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(d),
                    torch.from_numpy(np.ascontiguousarray(zeros)))


def row_order_unpermute(rows: int, num_heads: int) -> np.ndarray:
    """Row indices that undo llama.cpp's q/k permutation (same as unpermute_rows)."""
    from pagedllm.weights.gguf import unpermute_rows
    return unpermute_rows(np.arange(rows).reshape(rows, 1), num_heads).reshape(rows)
