"""A GGUF header's metadata -> ModelConfig: the architecture's fields as llama.cpp writes
(and, where it fixes them in code rather than in the file, assumes) them, and the RoPE
forms it stores: rope_freqs divisors, linear scaling, LongRoPE's factor tables, partial
rotary. gguf.py reads the tensors.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from pagedllm.model_config import ModelConfig
from pagedllm.errors import ModelLoadError
from pagedllm.weights.rope import RopeScalingError, longrope_attention_factor, longrope_fields

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2",
                           "gemma3")
# llama.cpp's architecture names that differ from Hugging Face's (ModelConfig uses the latter;
# a Mixtral GGUF says "llama", with experts).
_ARCH_NAMES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}

def model_config(path: str, meta: dict, reader, num_tokens: int) -> ModelConfig:
    """The file's ModelConfig; refused (ModelLoadError) where a field is missing or a form is
    not supported, never guessed."""
    config = _model_config(path, meta, {t.name for t in reader.tensors}, num_tokens)
    return dataclasses.replace(config, **_rope_fields(path, meta, reader, config))


def _model_config(path: str, meta: dict, tensor_names: set[str], num_tokens: int) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            path, f"unknown architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key):
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(path, f"metadata field {arch}.{key} is missing")
        return value

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    num_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", num_heads))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    experts = {}
    if meta.get(f"{arch}.expert_count"):
        # llama.cpp renormalizes the chosen experts' weights for Mixtral and Qwen3-MoE alike.
        experts = {"num_experts": int(need("expert_count")),
                   "num_experts_per_tok": int(need("expert_used_count")),
                   "expert_intermediate_size": int(meta.get(f"{arch}.expert_feed_forward_length")
                                                   or need("feed_forward_length")),
                   "norm_topk_prob": True}
    gemma = _gemma_fields(meta, arch, hidden, num_heads) if arch in ("gemma2", "gemma3") else {}
    return ModelConfig(
        architecture=_ARCH_NAMES.get(arch, arch),
        **experts, **gemma,
        vocab_size=int(meta.get(f"{arch}.vocab_size", num_tokens)),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        name=os.path.basename(path).removesuffix(".gguf"),
    )


def _gemma_fields(meta: dict, arch: str, hidden: int, num_heads: int) -> dict:
    """Gemma 2 and 3's settings as llama.cpp reads them. Their GGUF has no
    query_pre_attn_scalar: llama.cpp scales by head_dim, or by hidden / heads for the 27B
    models (46 layers in Gemma 2, 62 in Gemma 3), as here. Gemma 2 slides on every other
    layer; Gemma 3 on five of every six, with its own RoPE base of 10,000 (unscaled) there,
    both fixed in llama.cpp rather than written to the file."""
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // num_heads))
    layers = int(meta[f"{arch}.block_count"])
    scalar = hidden // num_heads if layers in (46, 62) else head_dim
    softcap, final = (meta.get(f"{arch}.attn_logit_softcapping"),
                      meta.get(f"{arch}.final_logit_softcapping"))
    if arch == "gemma2":
        sliding, local_theta = tuple(range(0, layers, 2)), None
    else:
        sliding, local_theta = tuple(i for i in range(layers) if i % 6 < 5), 10000.0
    return {"hidden_act": "gelu_tanh", "embedding_scale": True, "sandwich_norms": True,
            "attn_scale": float(scalar) ** -0.5,
            "attn_softcap": float(softcap) if softcap else None,
            "final_softcap": float(final) if final else None,
            "sliding_window": meta.get(f"{arch}.attention.sliding_window"),
            "sliding_layers": sliding, "local_rope_theta": local_theta}


def _tensor_values(reader, name: str) -> np.ndarray | None:
    for tensor in reader.tensors:
        if tensor.name == name:
            return np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    return None


def _rope_fields(path: str, meta: dict, reader, config: ModelConfig) -> dict:
    """ModelConfig's RoPE fields beyond the base: the rotated dimensions (`rope.dimension_count`,
    Phi-4-mini rotates 3/4 of each head), LongRoPE's two factor tables (llama.cpp's
    `rope_factors_short` / `rope_factors_long` tensors, the original context and attention
    factor in metadata), or the divisors of _rope_factors."""
    arch = meta.get("general.architecture")
    fields = {}
    rotary_dim = int(meta.get(f"{arch}.rope.dimension_count") or config.head_dim)
    if rotary_dim % 2 or not 0 < rotary_dim <= config.head_dim:
        raise ModelLoadError(path, f"{arch}.rope.dimension_count {rotary_dim} does not fit "
                                   f"head_dim {config.head_dim}")
    if rotary_dim != config.head_dim:
        fields["rotary_dim"] = rotary_dim
    short = _tensor_values(reader, "rope_factors_short.weight")
    long = _tensor_values(reader, "rope_factors_long.weight")
    if short is not None or long is not None:
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if short is None or long is None or original is None:
            raise ModelLoadError(path, "LongRoPE needs rope_factors_short, rope_factors_long and "
                                       f"{arch}.rope.scaling.original_context_length")
        attention = meta.get(f"{arch}.rope.scaling.attn_factor")
        if attention is None:
            attention = longrope_attention_factor(config.max_position_embeddings / int(original),
                                                  int(original))
        try:
            return {**fields, **longrope_fields(list(short), list(long), rotary_dim, int(original),
                                                float(attention))}
        except RopeScalingError as exc:
            raise ModelLoadError(path, str(exc)) from exc
    factors = _rope_factors(path, meta, reader, config, rotary_dim)
    if factors is not None:
        fields["rope_freq_factors"] = factors
    return fields


def _rope_factors(path: str, meta: dict, reader, config: ModelConfig,
                  rotary_dim: int) -> tuple[float, ...] | None:
    """llama.cpp writes Llama 3's scaling as a `rope_freqs` tensor of divisors, and linear
    scaling as metadata; anything else that changes RoPE is refused, never ignored."""
    arch = meta.get("general.architecture")  # the file's name for it (keys are prefixed so)
    kind = meta.get(f"{arch}.rope.scaling.type")
    half = rotary_dim // 2
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            values = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
            if values.shape[0] != half:
                raise ModelLoadError(path, f"rope_freqs has {values.shape[0]} values, expected "
                                           f"{half} (rotated dimensions / 2)")
            return tuple(float(v) for v in values)
    if kind in (None, "none"):
        return None
    if kind == "linear":
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if factor is None:
            raise ModelLoadError(path, f"metadata field {arch}.rope.scaling.factor is missing")
        return (float(factor),) * half
    raise ModelLoadError(path, f"rope scaling type {kind!r} is not supported yet "
                               f"(supported: linear, and Llama 3's rope_freqs)")
