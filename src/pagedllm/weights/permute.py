"""llama.cpp stores the q and k projections with their rows permuted (pairs interleaved per
head, for its RoPE); the canonical (Hugging Face, rotate-half) order is recovered here, for
dense arrays and, as a row order, for 4-bit weights kept as codes."""
from __future__ import annotations

import numpy as np


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (HF rotate-half layout <- interleaved pairs)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def row_order_unpermute(rows: int, num_heads: int) -> np.ndarray:
    """Row indices that undo llama.cpp's q/k permutation (same as unpermute_rows)."""
    return unpermute_rows(np.arange(rows).reshape(rows, 1), num_heads).reshape(rows)
