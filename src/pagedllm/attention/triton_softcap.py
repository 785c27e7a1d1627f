"""The soft cap's tanh for the Triton attention kernels (triton_tiles.py):
Gemma 2's scores -> cap * tanh(s / cap)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh without cancellation: its series below |x| = 0.25 (error < 1e-9 there), else
    (1 - e) / (1 + e) with e = exp(-2|x|). The sigmoid form 2 sigmoid(2x) - 1 lost ~1e-4 of
    small values to the GPU's fast exp, which a soft cap of 50 turned into logits 6e-3 off."""
    ax = tl.abs(x)
    x2 = x * x
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0
                                                                     + x2 * (62.0 / 2835.0)))))
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    t = tl.where(ax < 0.25, small, big)
    return tl.where(x < 0, -t, t)
