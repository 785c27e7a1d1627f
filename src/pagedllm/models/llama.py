"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) in plain PyTorch.

One flat batch of tokens from many sequences, no padding. Weights use the canonical names
of pagedllm.weights; the KV cache and attention metadata are passed in, never global.
Shapes: T = tokens in the step, H = hidden size, D = head dim.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention import BACKENDS, AttentionMetadata, LayerKVCache
from pagedllm.config import ModelConfig
from pagedllm.models.decode_loop import DecodeLoop
from pagedllm.models.layer_ops import layer_ops
from pagedllm.models.output_head import output_head
from pagedllm.models.quant_linear import QuantLinear, quantized_matmul_available
from pagedllm.weights.q4 import Q4Weight
from pagedllm.weights.q8 import Q8Rows

# Decoder layers at each end whose 4-bit projections never round activations to int8.
EXACT_EDGE_LAYERS = 2

LOGIT_REFINE_CANDIDATES = 16


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with a residual: residual += x in place, then norm(residual)."""
        return self.ops.rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding:
    """Rotate-half RoPE tables: float32 cos/sin [max_positions, D], indexed by position.
    A plain object, not a module: model.to(bfloat16) must leave the tables float32."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, D]
        self.cos = emb.cos()
        self.sin = emb.sin()


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: str, ops):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, config.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v projections fused into one matrix: one GEMM instead of three.
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.rotary = rotary
        self.ops = ops
        self.backend = BACKENDS[backend](self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions, hidden, kv_cache, meta: AttentionMetadata):
        # RoPE on q and k, and this step's K/V stored at their slots, in one op.
        q = self.ops.rope_write_kv(self.qkv_proj(hidden), positions, self.rotary.cos,
                                   self.rotary.sin, kv_cache.key, kv_cache.value, meta.slot_mapping,
                                   self.num_heads, kv_cache.key_scale, kv_cache.value_scale)
        return self.o_proj(self.backend.forward(q, kv_cache, meta))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops):
        super().__init__()
        # gate and up projections fused: one GEMM, then SiLU(gate) * up.
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: str, ops):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, rotary, backend, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = MLP(config, ops)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        """Pre-norm residual block. The residual stream is carried separately and the adds are
        fused into the norms: returns (this layer's MLP output, residual before adding it)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 attention_backend: str = "batched", int8_activations: bool = True):
        super().__init__()
        self.config = config
        self.dtype = dtype
        # bfloat16 with 4-bit weights: whether large steps may round activations to int8
        # (q4_q8_gemm) in the layers between the exact edges.
        self.int8_activations = int8_activations
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        # The reference attention backend runs with the torch layer ops too: a pure-torch oracle.
        ops = layer_ops(use_kernels=attention_backend != "torch-reference")
        self.layers = nn.ModuleList(DecoderLayer(config, rotary, attention_backend, ops)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        # Embedding and output head stay exact (float32, or their 8-bit GGUF originals read
        # back row by row): bf16 logits flip greedy choices.
        self.embed_weight = torch.empty(0)
        self.lm_head_weight = torch.empty(0)
        self.embed_q8: Q8Rows | None = None
        self.decode_loop: DecodeLoop | None = None  # set by load_weights where it applies

    def load_weights(self, weights: dict[str, torch.Tensor], quantized: dict | None = None) -> None:
        """Take canonical weights (float32 tensors); cast the body to the model dtype. In
        bfloat16, projections whose 4-bit originals are given also get the int4 kernel."""
        weights = dict(weights)
        self.embed_weight = weights.pop("embed_tokens.weight").float().contiguous()
        head = weights.pop("lm_head.weight", None)
        self.lm_head_weight = self.embed_weight if head is None or self.config.tie_word_embeddings \
            else head.float().contiguous()
        weights = fuse_projections(weights, self.config.num_layers)
        missing, unexpected = self.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        self.layers.to(self.dtype)
        self.norm.to(self.dtype)
        if self.dtype == torch.bfloat16:
            # The output head is the largest matrix (49152 x 576 here): it is read as 8-bit
            # codes, and the top candidates are recomputed exactly anyway.
            quantized = quantized or {}
            tied = self.lm_head_weight is self.embed_weight
            head_name = "embed_tokens.weight" if tied else "lm_head.weight"
            self.lm_head = output_head(self.lm_head_weight, quantized.get(head_name),
                                       LOGIT_REFINE_CANDIDATES)
            if quantized and quantized_matmul_available():
                self._use_int4(fuse_quantized(quantized, self.config.num_layers))
            self._keep_q8_rows(quantized, tied=tied)
            self.decode_loop = DecodeLoop.build(self)

    def _keep_q8_rows(self, quantized: dict, tied: bool) -> None:
        """Drop the float32 embedding / head where their Q8_0 originals give the same rows
        (113 MB -> 31 MB each on the default model); the output head keeps what it reads."""
        embed = quantized.get("embed_tokens.weight")
        head = embed if tied else quantized.get("lm_head.weight")
        if isinstance(embed, Q8Rows):
            self.embed_q8, self.embed_weight = embed, torch.empty(0)
        if isinstance(head, Q8Rows):
            self.lm_head_weight = torch.empty(0)

    def _embedding_rows(self, index: torch.Tensor) -> torch.Tensor:
        return self.embed_q8.rows(index) if self.embed_q8 is not None else self.embed_weight[index]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[LayerKVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, H] in the model dtype."""
        hidden = self._embedding_rows(input_ids).to(self.dtype)
        if self.decode_loop is not None and self.decode_loop.applies(meta, hidden.shape[0]):
            hidden, residual = self.decode_loop(hidden, positions, kv_caches, meta)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        return self.norm(hidden, residual)

    def _use_int4(self, quantized: dict) -> None:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            # The outermost layers keep exact activations at every batch size: int8-rounded
            # ones there moved the logits most (benchmarks/int8_activations.py).
            int8 = self.int8_activations and EXACT_EDGE_LAYERS <= i <= last - EXACT_EDGE_LAYERS
            for parent, attr in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                 (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                prefix = "self_attn" if parent is layer.self_attn else "mlp"
                q4 = quantized.get(f"layers.{i}.{prefix}.{attr}.weight")
                if q4 is not None:
                    dense = getattr(parent, attr)
                    setattr(parent, attr, QuantLinear(dense.weight, dense.bias, q4, int8_activations=int8))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab] float32 logits; call it only for the rows that are sampled.
        In bfloat16, the output head (output_head.py) recomputes the top candidates exactly."""
        if self.dtype != torch.bfloat16:
            return hidden.float() @ self.lm_head_weight.T
        return self.lm_head(hidden)


def fuse_projections(weights: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Canonical q/k/v and gate/up weights -> the fused qkv_proj and gate_up_proj."""
    fused = dict(weights)
    for i in range(num_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        for kind in ("weight", "bias"):
            parts = [fused.pop(f"{attn}{p}_proj.{kind}", None) for p in "qkv"]
            if all(p is not None for p in parts):
                fused[f"{attn}qkv_proj.{kind}"] = torch.cat(parts)
        gate, up = fused.pop(f"{mlp}gate_proj.weight", None), fused.pop(f"{mlp}up_proj.weight", None)
        if gate is not None and up is not None:
            fused[f"{mlp}gate_up_proj.weight"] = torch.cat([gate, up])
    return fused


def fuse_quantized(quantized: dict, num_layers: int) -> dict:
    """4-bit q/k/v and gate/up weights -> fused, like fuse_projections (all parts or none)."""
    fused = dict(quantized)
    for i in range(num_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        parts = [fused.pop(f"{attn}{p}_proj.weight", None) for p in "qkv"]
        if all(p is not None for p in parts):
            fused[f"{attn}qkv_proj.weight"] = Q4Weight.cat(parts)
        parts = [fused.pop(f"{mlp}{p}_proj.weight", None) for p in ("gate", "up")]
        if all(p is not None for p in parts):
            fused[f"{mlp}gate_up_proj.weight"] = Q4Weight.cat(parts)
    return fused
