"""GGUF (llama.cpp's format) -> Checkpoint.

The header is read over mmap by gguf_file.py and tensors are dequantized by the `gguf`
package's vectorised numpy code. llama.cpp's converter permutes the rows of attn_q / attn_k for the
llama architecture (interleaved RoPE pairs); we undo it so one RoPE layout serves all.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from pagedllm.model_config import ModelConfig
from pagedllm.errors import ModelLoadError
from pagedllm.weights.gguf_config import model_config
from pagedllm.weights.gguf_file import GGUFFile
from pagedllm.weights.gguf_original import GGUFOriginal
from pagedllm.weights.lazy_weights import LazyWeights
from pagedllm.weights.permute import unpermute_rows

# Quantized matrices stay in their own format until the model builder picks their form
# (gguf_original.py); vectors and float types are read as float32 here,
# through the gguf package's dequantizers.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
                          "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
_FLOAT_TYPES = ("F32", "F16", "BF16")
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


def _open_reader(path: str) -> GGUFFile:
    try:
        return GGUFFile(path)
    except Exception as exc:  # noqa: BLE001 - any parse failure means a bad file
        size = os.path.getsize(path)
        raise ModelLoadError(
            path, f"not a readable GGUF file ({size} bytes; {type(exc).__name__}: {exc})"
        ) from exc


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
    meta = dict(reader.fields)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = model_config(path, meta, reader, len(tokens))
    return reader, meta, config


def tokenizer_metadata(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def load_gguf(path: str, progress=None):
    from gguf import GGMLQuantizationType, quants

    from pagedllm.weights import Checkpoint

    reader, meta, config = read_gguf_header(path)

    weights: dict[str, torch.Tensor] = {}
    originals: dict[str, GGUFOriginal] = {}
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
        heads = _permuted_heads(config, tensor.name)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists columns first
        if type_name not in _FLOAT_TYPES and len(shape) in (2, 3):
            # Matrices (and stacked experts) stay in the file until the model builder asks
            # (gguf_original.py).
            mapping = (getattr(reader.data, "_mmap", None), tensor.data_offset, int(tensor.n_bytes))
            originals[name] = GGUFOriginal(tensor.name, tensor.data, type_name, shape, heads,
                                           mapping if mapping[0] is not None else None)
            continue
        # np.array copies: memmapped F32 tensors are read-only views of the file.
        array = np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if heads:
            array = unpermute_rows(array, heads)
        weights[name] = torch.from_numpy(np.ascontiguousarray(array))

    return Checkpoint(path=path, config=config, weights=LazyWeights(weights, originals),
                      tokenizer_source={"gguf": tokenizer_metadata(meta)}, quantized=originals)


def _permuted_heads(config: ModelConfig, gguf_name: str) -> int | None:
    """How many heads llama.cpp permuted this tensor's rows by, or None."""
    if config.architecture not in PERMUTED_ARCHITECTURES:
        return None
    if gguf_name.endswith("attn_q.weight"):
        return config.num_heads
    if gguf_name.endswith("attn_k.weight"):
        return config.num_kv_heads
    return None
