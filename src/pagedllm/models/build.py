"""Builds a model from a checkpoint's weights: the one place where its implementations are
chosen. The model (llama.py) is plain PyTorch; here it is filled with canonical weights,
cast to its dtype, and in bfloat16 given its 4-bit linear layers, its output head and, where
every layer is on the C++ path, its decode loop, all picked from what the CPU level's kernels
(pagedllm.kernels: capabilities, kernel_ops, torch_ops) offer.
"""
from __future__ import annotations

import torch

from pagedllm.attention.batched import BatchedBackend
from pagedllm.config import ModelConfig
from pagedllm.kernels import kernel_ops, torch_ops
from pagedllm.models.decode_loop import DecodeLoop
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.output_head import output_head
from pagedllm.models.quant_linear import QuantLinear
from pagedllm.weights.fuse import fuse_experts, fuse_projections, fuse_quantized
from pagedllm.weights.q8 import Q8Rows

# Decoder layers at each end whose 4-bit projections never round activations to int8: there
# int8-rounded activations moved the logits most (benchmarks/int8_activations.py).
EXACT_EDGE_LAYERS = 2
# The output head's candidates per row recomputed exactly (output_head.py).
LOGIT_REFINE_CANDIDATES = 16
PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
               ("mlp", "down_proj"))


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], quantized: dict | None = None,
                dtype: torch.dtype = torch.float32, attention_backend: str = "batched",
                int8_activations: bool = True) -> LlamaForCausalLM:
    """Canonical weights (float32 tensors) and, optionally, their 4-bit / 8-bit GGUF originals
    -> a ready model. In bfloat16, projections with 4-bit originals run on the 4-bit kernels
    (int8-rounded activations for large steps unless int8_activations is off)."""
    model = LlamaForCausalLM(config, dtype, attention_backend)
    weights = dict(weights)
    model.embed_weight = weights.pop("embed_tokens.weight").float().contiguous()
    head = weights.pop("lm_head.weight", None)
    tied = head is None or config.tie_word_embeddings
    model.lm_head_weight = model.embed_weight if tied else head.float().contiguous()
    weights = fuse_projections(weights, config.num_layers)
    if config.rotary_dim:
        weights = _permute_for_partial_rotary(weights, config)
    if config.num_experts:
        weights = fuse_experts(weights, config.num_layers, config.num_experts)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.layers.to(dtype)
    model.norm.to(dtype)
    if dtype == torch.bfloat16:
        quantized = quantized or {}
        # The output head is the largest matrix (49152 x 576 here): it is read as 8-bit
        # codes, and the top candidates are recomputed exactly anyway.
        head_name = "embed_tokens.weight" if tied else "lm_head.weight"
        model.lm_head = output_head(model.lm_head_weight, quantized.get(head_name),
                                    LOGIT_REFINE_CANDIDATES)
        if quantized and (kernel_ops() is not None or torch_ops().int4_matmul):
            _use_4bit(model, fuse_quantized(quantized, config.num_layers), int8_activations)
        _keep_q8_rows(model, quantized, tied)
        model.decode_loop = decode_loop_for(model)
    return model


def rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dimensions that puts partial RoPE in rotate-half form over the
    whole head: each half is (its half of the rotated dimensions, then half of the passing
    ones), so dimension d pairs with d + head_dim / 2 as the kernels rotate, and the passing
    pairs meet cos 1, sin 0 (RotaryEmbedding). q and k get the same order, so q.k is
    unchanged."""
    half_rot, half_pass = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = list(range(half_rot)) + list(range(rotary_dim, rotary_dim + half_pass))
    second = list(range(half_rot, rotary_dim)) + list(range(rotary_dim + half_pass, head_dim))
    return torch.tensor(first + second)


def _permute_for_partial_rotary(weights: dict, config: ModelConfig) -> dict:
    order = rotary_permutation(config.head_dim, config.rotary_dim)
    d, q_heads, kv_heads = config.head_dim, config.num_heads, config.num_kv_heads
    # Rows of the fused qkv: q heads, k heads (permuted within each head), then v (as is).
    rows = torch.cat([(h * d + order) for h in range(q_heads + kv_heads)]
                     + [torch.arange((q_heads + kv_heads) * d, (q_heads + 2 * kv_heads) * d)])
    out = dict(weights)
    for i in range(config.num_layers):
        for kind in ("weight", "bias"):
            name = f"layers.{i}.self_attn.qkv_proj.{kind}"
            if name in out:
                out[name] = out[name][rows].contiguous()
        for norm in ("q_norm", "k_norm"):
            name = f"layers.{i}.self_attn.{norm}.weight"
            if name in out:
                out[name] = out[name][order].contiguous()
    return out


def _use_4bit(model: LlamaForCausalLM, quantized: dict, int8_activations: bool) -> None:
    last = len(model.layers) - 1
    for i, layer in enumerate(model.layers):
        int8 = int8_activations and EXACT_EDGE_LAYERS <= i <= last - EXACT_EDGE_LAYERS
        for part, name in PROJECTIONS:
            if name == "qkv_proj" and model.config.rotary_dim:
                continue  # its rows were permuted (partial rotary): the dense copy runs
            q4 = quantized.get(f"layers.{i}.{part}.{name}.weight")
            if q4 is not None:
                parent = getattr(layer, part)
                dense = getattr(parent, name)
                setattr(parent, name, QuantLinear(dense.weight, dense.bias, q4, int8_activations=int8))


def _keep_q8_rows(model: LlamaForCausalLM, quantized: dict, tied: bool) -> None:
    """Drop the float32 embedding / head where their Q8_0 originals give the same rows
    (113 MB -> 31 MB each on the default model); the output head keeps what it reads."""
    embed = quantized.get("embed_tokens.weight")
    head = embed if tied else quantized.get("lm_head.weight")
    if isinstance(embed, Q8Rows):
        model.embed_q8, model.embed_weight = embed, torch.empty(0)
    if isinstance(head, Q8Rows):
        model.lm_head_weight = torch.empty(0)


def decode_loop_for(model: LlamaForCausalLM) -> DecodeLoop | None:
    """The C++ decode loop, given the layers' weights, where every layer is on the fast
    bfloat16 path (4-bit projections on pagedllm's kernels without bias, the C++ layer ops and
    decode attention, one exact-row limit a layer); None elsewhere."""
    ops = kernel_ops()
    config = model.config
    if (ops is None or model.dtype != torch.bfloat16 or config.num_experts
            or config.sandwich_norms or config.sliding_window is not None):
        return None  # (the C++ loop runs Llama-shaped layers with dense MLPs, no window, only)
    weights, max_rows, exact_max_rows = [], [], []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [getattr(getattr(layer, part), name) for part, name in PROJECTIONS]
        if not all(isinstance(p, QuantLinear) and p.q4_ops is ops and p.bias is None for p in projections):
            return None
        if attn.q_norm is not None:  # the C++ loop has no per-head q/k norm (Qwen3)
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(m.ops is not ops for m in (*norms, attn, mlp)):
            return None
        if not isinstance(attn.backend, BatchedBackend) or attn.backend.kernel is not ops:
            return None
        exact = {p.exact_max_rows for p in projections}
        if len(exact) != 1:
            return None
        weights += [layer.input_layernorm.weight, attn.qkv_proj.packed, attn.o_proj.packed,
                    layer.post_attention_layernorm.weight, mlp.gate_up_proj.packed,
                    mlp.down_proj.packed]
        max_rows += [p.max_rows for p in projections]
        exact_max_rows += exact
    first = model.layers[0]
    return DecodeLoop(ops, weights, first.self_attn.rotary.cos, first.self_attn.rotary.sin,
                      first.self_attn.num_heads, first.input_layernorm.eps,
                      first.self_attn.backend.scale, min(max_rows), exact_max_rows)
