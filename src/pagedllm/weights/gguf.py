"""GGUF (llama.cpp's format) -> Checkpoint.

The header is parsed over mmap by the `gguf` package and tensors are dequantized by its
vectorised numpy code. llama.cpp's converter permutes the rows of attn_q / attn_k for the
llama architecture (interleaved RoPE pairs); we undo it so one RoPE layout serves all.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

from pagedllm.config import ModelConfig
from pagedllm.weights.errors import ModelLoadError
from pagedllm.weights.permute import row_order_unpermute, unpermute_rows
from pagedllm.weights.q4 import Q4Weight, decode_q4
from pagedllm.weights.q8 import decode_q8_0
from pagedllm.weights.rope import RopeScalingError, longrope_attention_factor, longrope_fields

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2",
                           "gemma3")
# llama.cpp's architecture names that differ from Hugging Face's (ModelConfig uses the latter;
# a Mixtral GGUF says "llama", with experts).
_ARCH_NAMES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
# Read through the gguf package's dequantizers; only Q4_0/Q4_1 projections (4-bit kernels)
# and a Q8_0 embedding/head (8-bit rows) stay in their own format, the rest become dense.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
                          "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
# Architectures whose q/k rows llama.cpp's converter permutes.
PERMUTED_ARCHITECTURES = ("llama", "mistral")

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3 stores q, k and v fused
    "post_attention_norm.weight": "self_attn_output_norm",  # Gemma 2 (renamed in _gemma2_names)
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    # mixtures of experts: the router, and every expert's matrices stacked [E, rows, cols]
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_exps.weight": "mlp.experts_gate",
    "ffn_up_exps.weight": "mlp.experts_up",
    "ffn_down_exps.weight": "mlp.experts_down",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


def canonical_name(gguf_name: str) -> str | None:
    """Map a GGUF tensor name to our canonical name; None for tensors we do not use."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None  # e.g. rope_freqs: read into the config (_rope_factors), not a weight


def _field_value(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - a malformed field is reported by its user
        return None


def _open_reader(path: str):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure means a bad file
        size = os.path.getsize(path)
        raise ModelLoadError(
            path, f"not a readable GGUF file ({size} bytes; {type(exc).__name__}: {exc})"
        ) from exc


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


def _gemma2_names(name: str) -> str:
    """In Gemma 2 and 3's GGUF, ffn_norm is the norm before the MLP and post_attention_norm the one
    on the attention's output (in Llama's naming, post_attention_layernorm is the former)."""
    if name.endswith("post_attention_layernorm.weight"):
        return name.replace("post_attention_layernorm", "pre_feedforward_layernorm")
    if name.endswith("self_attn_output_norm"):
        return name.replace("self_attn_output_norm", "post_attention_layernorm.weight")
    return name


def read_gguf_header(path: str):
    """(reader, metadata, ModelConfig) from a GGUF file's header; tensors stay on disk (but
    the few numbers of a rope_freqs tensor, which belong to the config)."""
    reader = _open_reader(path)
    meta = {name: _field_value(field) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = _model_config(path, meta, {t.name for t in reader.tensors}, len(tokens))
    config = dataclasses.replace(config, **_rope_fields(path, meta, reader, config))
    return reader, meta, config


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


def tokenizer_metadata(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def load_gguf(path: str, progress=None):
    from gguf import GGMLQuantizationType, quants

    from pagedllm.weights import Checkpoint

    reader, meta, config = read_gguf_header(path)

    file_size = os.path.getsize(path)
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, Q4Weight] = {}
    for index, tensor in enumerate(reader.tensors):
        if progress is not None:
            progress(index + 1, len(reader.tensors))
        name = canonical_name(tensor.name)
        if name is None:
            continue
        if config.architecture in ("gemma2", "gemma3_text"):
            name = _gemma2_names(name)
        if config.architecture == "phi3" and name.endswith("mlp.up_proj.weight"):
            name = name.replace("up_proj", "gate_up_proj")  # Phi-3's ffn_up is gate and up
        type_name = GGMLQuantizationType(tensor.tensor_type).name
        if type_name not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                path, f"tensor {tensor.name} has unsupported type {type_name}; "
                f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
            )
        if tensor.data_offset + int(tensor.n_bytes) > file_size:
            raise ModelLoadError(path, f"file is truncated: tensor {tensor.name} ends past "
                                       f"byte {file_size}")
        # np.array copies: memmapped F32 tensors are read-only views of the file.
        array = np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        heads = _permuted_heads(config, tensor.name)
        if heads:
            array = unpermute_rows(array, heads)
        weights[name] = torch.from_numpy(np.ascontiguousarray(array))
        if type_name == "Q8_0" and name in ("embed_tokens.weight", "lm_head.weight"):
            quantized[name] = decode_q8_0(tensor.data, array.shape)
        if type_name in ("Q4_0", "Q4_1") and name != "embed_tokens.weight" and array.ndim == 2:
            q4 = decode_q4(tensor.data, type_name, array.shape)
            quantized[name] = q4.permute_rows(row_order_unpermute(array.shape[0], heads)) if heads else q4

    return Checkpoint(path=path, config=config, weights=weights,
                      tokenizer_source={"gguf": tokenizer_metadata(meta)}, quantized=quantized)


def _permuted_heads(config: ModelConfig, gguf_name: str) -> int | None:
    """How many heads llama.cpp permuted this tensor's rows by, or None."""
    if config.architecture not in PERMUTED_ARCHITECTURES:
        return None
    if gguf_name.endswith("attn_q.weight"):
        return config.num_heads
    if gguf_name.endswith("attn_k.weight"):
        return config.num_kv_heads
    return None
