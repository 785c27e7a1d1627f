"""Builds a model from a checkpoint's weights: the one place where its implementations are
chosen. The decoder stack (llama.py, plain PyTorch) is loaded with canonical weights and
cast to its dtype, in bfloat16 with its low-bit linear layers; then the embedding, the output
head and, where every layer is on the C++ path, the decode loop are made, and the model is
constructed complete from these parts. Everything is picked from what the backend (chosen
once for the process: backends/) offers; no module below asks for kernels on its own.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from pagedllm.attention.batched import BatchedBackend
from pagedllm.model_config import ModelConfig
from pagedllm.backends import Backend, cpu_backend
from pagedllm.models.decode_loop import DecodeLoop
from pagedllm.models.llama import DecoderStack, LlamaForCausalLM
from pagedllm.models.low_bit import (EMBEDDING_NAMES, FUSED_PROJECTIONS, install_projections,
                                     kept_originals, uninitialised_linears)
from pagedllm.models.output_head import DeviceHead, ExactHead, TokenEmbedding, output_head
from pagedllm.models.moe import MoE
from pagedllm.models.quant_linear import (ALL_ROWS, DenseLinear, Int8ActivationLinear, QuantLinear,
                                          StackedLinear)
from pagedllm.weights.fuse import fuse_experts, fuse_projections, fuse_quantized

# Decoder layers at each end whose 4-bit projections never round activations to int8: there
# int8-rounded activations moved the logits most (benchmarks/int8_activations.py).
EXACT_EDGE_LAYERS = 2
# The output head's candidates per row recomputed exactly (output_head.py).
LOGIT_REFINE_CANDIDATES = 16
PROJECTIONS = tuple((part, fused) for part, fused, _ in FUSED_PROJECTIONS)


def build_model(config: ModelConfig, weights: Mapping[str, torch.Tensor], quantized: dict | None = None,
                dtype: torch.dtype = torch.float32, backend: Backend | None = None,
                attention_backend: str = "batched", int8_activations: bool = True,
                device_four_bit: bool = False, device_fp8: bool = False) -> LlamaForCausalLM:
    """Canonical weights (float32 tensors) and, optionally, their GGUF originals -> a ready
    model. In bfloat16 with the C++ kernels, quantized projections, embedding and head run on
    their codes (low_bit.py: int8-rounded activations for large steps unless int8_activations
    is off) and are never read from `weights`; everything else is. backend: the engine's
    (None: this process's CPU backend, for a model built alone). device_four_bit: on the
    generic backend, 4-bit projections stay 4-bit on its device (int4_triton.py).
    device_fp8: on the generic backend, the projections as float8 (fp8_linear.py)."""
    backend = backend or cpu_backend()
    four_bit_on_device = {}
    if backend.generic and device_four_bit:
        four_bit_on_device = {name: original.q4() for name, original in (quantized or {}).items()
                              if original.four_bit and name not in EMBEDDING_NAMES}
    quantized = {} if backend.generic else (quantized or {})
    if backend.generic and attention_backend == "batched":
        attention_backend = backend.attention
    low_bit_ops = backend.kernels if dtype == torch.bfloat16 else None
    kept = kept_originals(config, quantized, low_bit_ops)
    with uninitialised_linears():
        stack = DecoderStack(config, dtype, backend, attention_backend)
    dense = {name: weights[name] for name in weights if name not in kept}
    tied = "lm_head.weight" not in weights or config.tie_word_embeddings
    embedding, head_weight = _embedding(config, dense, kept, tied)
    _load_stack(stack, kept, dense, int8_activations, backend)
    if backend.generic:  # every matrix dense in the model dtype, on the backend's device
        if four_bit_on_device:  # (but these)
            _use_device_int4(stack, fuse_quantized(four_bit_on_device, config.num_layers))
        if device_fp8:
            _use_device_fp8(stack)
        head = (DeviceHead(head_weight, LOGIT_REFINE_CANDIDATES) if dtype == torch.bfloat16
                else ExactHead(head_weight))
        return LlamaForCausalLM(stack, embedding, head).to_device(backend.device)
    if dtype != torch.bfloat16:
        return LlamaForCausalLM(stack, embedding, ExactHead(head_weight))
    head = _bfloat16_head(head_weight, embedding, kept, tied, backend)
    _prepack_dense_experts(stack, backend)
    if low_bit_ops is None and backend.torch_ops.int4_matmul:
        four_bit = {name: original.q4() for name, original in quantized.items()
                    if original.four_bit and name not in EMBEDDING_NAMES}
        _use_torch_int4(stack, fuse_quantized(four_bit, config.num_layers), int8_activations,
                        backend)
    return LlamaForCausalLM(stack, embedding, head, decode_loop_for(stack, backend.kernels))


def _embedding(config: ModelConfig, dense: dict, kept: dict, tied: bool
               ) -> tuple[TokenEmbedding, torch.Tensor]:
    """The token embedding (exact: float32, or rows read back from 8-bit codes, exact for
    Q8_0) and the output head's float weight (the embedding's when tied; empty where only
    codes are kept)."""
    embed, head = dense.pop("embed_tokens.weight", None), dense.pop("lm_head.weight", None)
    scale = config.hidden_size ** 0.5 if config.embedding_scale else None
    if "embed_tokens.weight" in kept:
        embedding = TokenEmbedding(None, kept["embed_tokens.weight"].q8(), scale)
        embed_weight = torch.empty(0)
    else:
        embed_weight = embed.float().contiguous()
        embedding = TokenEmbedding(embed_weight, None, scale)
    head_weight = embed_weight if tied or head is None else head.float().contiguous()
    return embedding, head_weight


def _load_stack(stack: DecoderStack, kept: dict, dense: dict, int8_activations: bool,
                backend: Backend) -> None:
    """The decoder layers' weights: low-bit modules where codes are kept, the rest loaded
    into the stack and cast to its dtype."""
    config, num_layers = stack.config, stack.config.num_layers
    dense = fuse_projections(dense, num_layers)
    if config.rotary_dim:
        dense = _permute_for_partial_rotary(dense, config)
    if config.num_experts:
        dense = fuse_experts(dense, num_layers, config.num_experts)
    install_projections(stack, kept, dense, _int8_layers(num_layers, int8_activations), backend)
    missing, unexpected = stack.load_state_dict(dense, strict=False)
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    stack.to(stack.dtype)


def _bfloat16_head(weight: torch.Tensor, embedding: TokenEmbedding, kept: dict, tied: bool,
                   backend: Backend):
    """The output head is the largest matrix (49152 x 576 on the default model): it is read
    as 8-bit codes where it has them (6-bit where the file holds Q6_K), and the top
    candidates are recomputed exactly anyway."""
    head_q8 = head_q6 = None
    head_name = "embed_tokens.weight" if tied else "lm_head.weight"
    if not tied and head_name in kept:
        head_q8 = kept[head_name].q8()
    elif tied:
        head_q8 = embedding.q8
    if head_q8 is not None and kept[head_name].six_bit:  # multiplied as the file holds it
        head_q6 = kept[head_name].q6()
    return output_head(weight, head_q8, LOGIT_REFINE_CANDIDATES, backend, head_q6)


def _prepack_dense_experts(model: DecoderStack, backend: Backend) -> None:
    """bfloat16 experts from a float checkpoint: each expert's matrices reordered once for
    oneDNN (DenseLinear), as the dense projections are, instead of on every matmul. Where the
    CPU level has no bfloat16 arithmetic DenseLinear would widen them to float32, twice the
    memory, so the stacked parameters stay."""
    if not backend.prepacks_bfloat16:
        return
    for layer in model.layers:
        mlp = layer.mlp
        if isinstance(mlp, MoE) and mlp.expert_modules is None:
            mlp.use_expert_modules([(DenseLinear(gate_up, None, backend), DenseLinear(down, None, backend))
                                    for gate_up, down in zip(mlp.experts_gate_up, mlp.experts_down)])


def _int8_layers(num_layers: int, int8_activations: bool) -> set[int]:
    """Layers whose 4-bit projections may round large steps' activations to int8."""
    if not int8_activations:
        return set()
    return set(range(EXACT_EDGE_LAYERS, num_layers - EXACT_EDGE_LAYERS))


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


def _use_torch_int4(model: DecoderStack, quantized: dict, int8_activations: bool,
                    backend: Backend) -> None:
    """Without the C++ kernels: 4-bit projections on torch's int4 kernel, a dense copy beside."""
    int8_layers = _int8_layers(len(model.layers), int8_activations)
    _replace_4bit_projections(model, quantized, lambda i, dense, q4: QuantLinear(
        dense.weight, dense.bias, q4, backend, int8_activations=i in int8_layers))


def _use_device_int4(model: DecoderStack, quantized: dict) -> None:
    """The generic backend's 4-bit projections: the file's codes, unpacked on its device by
    the Triton kernel (decode) or dequantized per call (prefill)."""
    from pagedllm.models.int4_triton import Int4Linear

    _replace_4bit_projections(model, quantized, lambda i, dense, q4: Int4Linear(q4, dense.bias))


def _use_device_fp8(model: DecoderStack) -> None:
    """The generic backend's projections as float8 with a scale a row (fp8_linear.py), from
    their dense matrices; one whose sides do not fit stays dense, as do a mixture of
    experts' stacked matrices."""
    from pagedllm.models.fp8_linear import Fp8Linear, fits

    for layer in model.layers:
        for part, name in PROJECTIONS:
            parent = getattr(layer, part, None)
            dense = getattr(parent, name, None)
            if isinstance(dense, torch.nn.Linear) and fits(dense.weight):
                setattr(parent, name, Fp8Linear(dense.weight, dense.bias))


def _replace_4bit_projections(model: DecoderStack, quantized: dict, make) -> None:
    """Each projection with 4-bit codes in `quantized` (fused names) replaced by
    make(layer index, the dense module, the codes)."""
    for i, layer in enumerate(model.layers):
        for part, name in PROJECTIONS:
            if name == "qkv_proj" and model.config.rotary_dim:
                continue  # its rows were permuted (partial rotary): the dense copy runs
            q4 = quantized.get(f"layers.{i}.{part}.{name}.weight")
            if q4 is not None:
                parent = getattr(layer, part)
                setattr(parent, name, make(i, getattr(parent, name), q4))


def decode_loop_for(model: DecoderStack | LlamaForCausalLM, ops) -> DecodeLoop | None:
    """The C++ decode loop, given the layers' weights, where every layer is on the fast
    bfloat16 path (projections on pagedllm's low-bit kernels without bias, in parts where a
    fused projection mixes formats; the C++ layer ops and decode attention; one exact-row
    limit a layer); None elsewhere. ops: the backend's compiled kernels."""
    config = model.config
    if (ops is None or model.dtype != torch.bfloat16 or config.num_experts
            or config.sandwich_norms or config.sliding_window is not None):
        return None  # (the C++ loop runs Llama-shaped layers with dense MLPs, no window, only)
    weights, max_rows, exact_max_rows, amx_min_rows, int16_max_rows = [], [], [], set(), set()
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [_kernel_parts(getattr(getattr(layer, part), name), ops)
                       for part, name in PROJECTIONS]
        if any(parts is None for parts in projections):
            return None
        if attn.q_norm is not None:  # the C++ loop has no per-head q/k norm (Qwen3)
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(m.ops is not ops for m in (*norms, attn, mlp)):
            return None
        if not isinstance(attn.backend, BatchedBackend) or attn.backend.kernel is not ops:
            return None
        four_bit = [m for parts in projections for m in parts if isinstance(m, QuantLinear)]
        exact = {m.exact_max_rows for m in four_bit}
        amx = {m.amx_exact_min_rows for m in four_bit}
        int16 = {m.int16_max_rows for m in four_bit}
        if len(exact) > 1 or len(amx) > 1 or len(int16) > 1:
            return None
        packed = [[m.packed for m in parts] for parts in projections]
        weights += [[layer.input_layernorm.weight], packed[0], packed[1],
                    [layer.post_attention_layernorm.weight], packed[2], packed[3]]
        max_rows += [m.max_rows for m in four_bit]
        exact_max_rows.append(exact.pop() if exact else ALL_ROWS)
        amx_min_rows.update(amx)
        int16_max_rows.update(int16)
    if len(amx_min_rows) > 1 or len(int16_max_rows) > 1:
        return None
    first = model.layers[0]
    return DecodeLoop(ops, weights, first.self_attn.rotary.cos, first.self_attn.rotary.sin,
                      first.self_attn.num_heads, first.input_layernorm.eps,
                      first.self_attn.backend.scale, min(max_rows, default=ALL_ROWS), exact_max_rows,
                      amx_min_rows.pop() if amx_min_rows else ALL_ROWS,
                      int16_max_rows.pop() if int16_max_rows else 0)


def _kernel_parts(module, ops) -> list | None:
    """A projection's modules on the low-bit kernels of `ops`, without bias, in the order
    their outputs sit side by side; None if any part runs elsewhere."""
    parts = module.parts if isinstance(module, StackedLinear) and module.bias is None else [module]
    for part in parts:
        on_kernels = ((isinstance(part, QuantLinear) and part.q4_ops is ops)
                      or (isinstance(part, Int8ActivationLinear)
                          and part.gemm in (ops.q6_gemm, ops.q8_gemm)))
        if not on_kernels or part.bias is not None:
            return None
    return parts
