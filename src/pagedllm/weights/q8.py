"""A GGUF Q8_0 matrix kept 8-bit, read back row by row.

The default model's token embedding (tied to the output head) is Q8_0: 49152 x 576 values
that take 113 MB in float32 and 31 MB as codes + scales. The bfloat16 model only ever needs
a few exact rows at a time (the step's input tokens; the output head's top candidates), so
it keeps this form and dequantizes those rows on demand, bit-identical to the full float32
dequantization.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP_SIZE = 32
_BLOCK_BYTES = 34  # float16 scale + 32 int8 codes


@dataclass
class Q8Rows:
    codes: torch.Tensor  # [rows, cols] int8
    scales: torch.Tensor  # [rows, cols / 32] float32

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """index of any shape -> float32 rows [*index.shape, cols]."""
        cols = self.codes.shape[1]
        flat = index.reshape(-1)
        groups = self.codes[flat].float().view(-1, cols // GROUP_SIZE, GROUP_SIZE)
        values = (groups * self.scales[flat].unsqueeze(-1)).view(-1, cols)
        return values.view(*index.shape, cols)

    @staticmethod
    def cat(parts: list[Q8Rows]) -> Q8Rows:
        return Q8Rows(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))


def decode_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> Q8Rows:
    """raw: the tensor's bytes as stored in the GGUF file; shape: (rows, cols)."""
    rows, cols = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // GROUP_SIZE, _BLOCK_BYTES)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return Q8Rows(torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scales)))


def quantize_q8_0(weights: torch.Tensor) -> Q8Rows:
    """float [rows, cols] -> Q8_0 as llama.cpp rounds it: per group of 32, d = max|w| / 127
    (a float16), codes round(w / d). For a weight stored in another format (Q6_K, Q5_K, ...)
    that the 8-bit kernel then reads: each value moves by at most half a step, d / 2."""
    rows, cols = weights.shape
    groups = weights.float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    d = (groups.abs().amax(dim=-1) / 127).half().float()
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = (groups * inverse.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8)
    return Q8Rows(codes.reshape(rows, cols), d)
