"""RoPE scaling as per-dimension frequency divisors, the one form every source reduces to:
a Hugging Face config's `rope_scaling` ("linear", "llama3") and a GGUF's `rope_freqs` tensor
(llama.cpp's form of Llama 3's scaling) or `rope.scaling.type` linear. The model divides
each inverse frequency by its factor (models/llama.py, RotaryEmbedding). LongRoPE (Phi-3.5,
Phi-4-mini) has two such tables and an attention factor: longrope_fields. Scalings that
change more than that (yarn's attention factor and ramp, dynamic NTK's length-dependent
base) are refused by name, never applied halfway.
"""
from __future__ import annotations

import math

SUPPORTED_ROPE_SCALINGS = ("default", "linear", "llama3", "longrope")


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


def longrope_attention_factor(extension: float, original_context: int) -> float:
    """LongRoPE's default scale of cos and sin: sqrt(1 + ln(s) / ln(original)), s the
    context's extension over the original (1 when not extended), as transformers'."""
    if extension <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(extension) / math.log(original_context))


def longrope_fields(short: list, long: list, rotary_dim: int, original_context: int,
                    attention_factor: float) -> dict:
    """ModelConfig's LongRoPE fields; each table has a divisor per rotated frequency."""
    for name, table in (("short_factor", short), ("long_factor", long)):
        if len(table) != rotary_dim // 2:
            raise RopeScalingError(f"longrope {name} has {len(table)} values, expected "
                                   f"{rotary_dim // 2} (rotated dimensions / 2)")
    return {"rope_freq_factors": tuple(float(v) for v in short),
            "rope_long_freq_factors": tuple(float(v) for v in long),
            "rope_original_context": int(original_context),
            "rope_attention_factor": float(attention_factor)}


def hf_longrope(rope: dict, raw: dict, rotary_dim: int) -> dict:
    """A config.json's longrope scaling as ModelConfig fields (transformers' rules: the
    original context from the config or the scaling, the attention factor from the ratio of
    the contexts unless given)."""
    try:
        original = int(raw.get("original_max_position_embeddings")
                       or rope["original_max_position_embeddings"])
        max_positions = int(raw.get("max_position_embeddings", original))
        factor = rope.get("factor")
        attention = rope.get("attention_factor")
        if attention is None:
            extension = max_positions / original if factor is None else float(factor)
            attention = longrope_attention_factor(extension, original)
        return longrope_fields(rope["short_factor"], rope["long_factor"], rotary_dim, original,
                               attention)
    except KeyError as exc:
        raise RopeScalingError(f"rope scaling 'longrope' needs {exc.args[0]!r}") from exc


def hf_rope_factors(rope: dict, head_dim: int, theta: float) -> tuple[float, ...] | None:
    """The divisors a config.json's rope_scaling asks for (None: plain RoPE). longrope has
    more than divisors: hf_longrope."""
    kind = rope_kind(rope)
    if kind not in SUPPORTED_ROPE_SCALINGS:
        raise RopeScalingError(f"rope scaling type {kind!r} is not supported yet "
                               f"(supported: {', '.join(SUPPORTED_ROPE_SCALINGS)})")
    if kind in ("default", "longrope"):
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


def rope_kind(rope: dict) -> str:
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    return "longrope" if kind == "su" else kind  # "su": Phi-3's first name for it
