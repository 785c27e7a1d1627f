"""RoPE scaling as per-dimension frequency divisors, the one form every source reduces to:
a Hugging Face config's `rope_scaling` ("linear", "llama3") and a GGUF's `rope_freqs` tensor
(llama.cpp's form of Llama 3's scaling) or `rope.scaling.type` linear. The model divides
each inverse frequency by its factor (models/llama.py, RotaryEmbedding). Scalings that
change more than the frequencies (yarn's attention factor, dynamic NTK's length-dependent
base, longrope's two tables) are refused by name, never applied halfway.
"""
from __future__ import annotations

import math

SUPPORTED_ROPE_SCALINGS = ("default", "linear", "llama3")


class RopeScalingError(ValueError):
    pass


def inverse_frequencies(head_dim: int, theta: float) -> list[float]:
    return [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]


def llama3_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                   high_freq_factor: float, original_max_positions: int) -> tuple[float, ...]:
    """Llama 3.1's scaling: long wavelengths slowed by `factor`, short ones kept, the band
    between blended smoothly (as transformers' and llama.cpp's implementations)."""
    low_freq_wavelen = original_max_positions / low_freq_factor
    high_freq_wavelen = original_max_positions / high_freq_factor
    divisors = []
    for inv_freq in inverse_frequencies(head_dim, theta):
        wavelen = 2 * math.pi / inv_freq
        if wavelen < high_freq_wavelen:
            divisors.append(1.0)
        elif wavelen > low_freq_wavelen:
            divisors.append(factor)
        else:
            smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
            divisors.append(inv_freq / scaled)
    return tuple(divisors)


def hf_rope_factors(rope: dict, head_dim: int, theta: float) -> tuple[float, ...] | None:
    """The divisors a config.json's rope_scaling asks for (None: plain RoPE)."""
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind not in SUPPORTED_ROPE_SCALINGS:
        raise RopeScalingError(f"rope scaling type {kind!r} is not supported yet "
                               f"(supported: {', '.join(SUPPORTED_ROPE_SCALINGS)})")
    if kind == "default":
        return None
    try:
        factor = float(rope["factor"])
        if kind == "linear":
            return (factor,) * (head_dim // 2)
        return llama3_factors(head_dim, theta, factor, float(rope.get("low_freq_factor", 1.0)),
                              float(rope.get("high_freq_factor", 4.0)),
                              int(rope["original_max_position_embeddings"]))
    except KeyError as exc:
        raise RopeScalingError(f"rope scaling {kind!r} needs {exc.args[0]!r}") from exc
