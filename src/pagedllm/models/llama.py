"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) in plain PyTorch.

One flat batch of tokens from many sequences, no padding. Weights use the canonical names
of pagedllm.weights; the KV cache and attention metadata are passed in, never global.
Shapes: T = tokens in the step, H = hidden size, D = head dim.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention import BACKENDS, AttentionMetadata
from pagedllm.config import ModelConfig
from pagedllm.models.quant_linear import QuantLinear, int4_available
from pagedllm.weights.q4 import Q4Weight

LOGIT_REFINE_CANDIDATES = 16


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the activation dtype, as the reference does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed float32 cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, config.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v projections fused into one matrix: one GEMM instead of three.
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary = rotary
        self.backend = BACKENDS[backend](self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions, hidden, kv_cache, meta: AttentionMetadata):
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.backend.forward(q, k, v, kv_cache, meta))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        # gate and up projections fused: one GEMM, then SiLU(gate) * up.
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, rotary, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, positions, hidden, kv_cache, meta):
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 attention_backend: str = "batched"):
        super().__init__()
        self.config = config
        self.dtype = dtype
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.rotary = rotary
        self.layers = nn.ModuleList(DecoderLayer(config, rotary, attention_backend)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Embedding and output head stay float32: bf16 logits flip greedy choices.
        self.embed_weight = torch.empty(0)
        self.lm_head_weight = torch.empty(0)

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
            self.lm_head_bf16 = self.lm_head_weight.to(torch.bfloat16)
            if quantized and int4_available():
                self._use_int4(fuse_quantized(quantized, self.config.num_layers))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, H] in the model dtype."""
        hidden = self.embed_weight[input_ids].to(self.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden)

    def _use_int4(self, quantized: dict) -> None:
        for i, layer in enumerate(self.layers):
            for parent, attr in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                 (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                prefix = "self_attn" if parent is layer.self_attn else "mlp"
                q4 = quantized.get(f"layers.{i}.{prefix}.{attr}.weight")
                if q4 is not None:
                    setattr(parent, attr, QuantLinear(getattr(parent, attr), q4))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab] float32 logits; call it only for the rows that are sampled.

        In bfloat16 the full product runs in bf16 (2-3x faster), then the top candidates are
        recomputed in float32: bf16-rounded logits alone flip greedy choices on this model."""
        if self.dtype != torch.bfloat16:
            return hidden.float() @ self.lm_head_weight.T
        logits = torch.nn.functional.linear(hidden.to(torch.bfloat16), self.lm_head_bf16).float()
        top = logits.topk(LOGIT_REFINE_CANDIDATES, dim=-1).indices  # [N, k]
        exact = torch.einsum("nh,nkh->nk", hidden.float(), self.lm_head_weight[top])
        return logits.scatter_(1, top, exact)


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
