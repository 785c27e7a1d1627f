"""The element-wise parts of a decoder layer, in two interchangeable implementations.

`TorchLayerOps` is plain torch and the reference; the C++ module from pagedllm.kernels has
the same three functions fused into one pass each (the backend picks: Backend.layer_ops).
Signatures:
  rms_norm(x, residual, weight, eps) -> normed; with a residual, residual += x in place first
  rope_write_kv(qkv, positions, cos, sin, key_cache, value_cache, slot_mapping, num_heads,
                key_scales=None, value_scales=None) -> q   (scales: for int8 caches)
  silu_and_mul(gate_up) -> silu(gate) * up
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.torch_reference import write_kv


class TorchLayerOps:
    @staticmethod
    def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
        if residual is not None:
            x = residual.add_(x)
        # Normalise in float32 whatever the activation dtype, as the reference does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    @staticmethod
    def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, num_heads: int,
                      key_scales: torch.Tensor | None = None,
                      value_scales: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens = qkv.shape[0]
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                             num_kv_heads * head_dim], dim=-1)
        q = q.view(num_tokens, num_heads, head_dim)
        k = k.view(num_tokens, num_kv_heads, head_dim)
        v = v.reshape(num_tokens, num_kv_heads, head_dim)
        cos = cos[positions].unsqueeze(1).to(qkv.dtype)  # [T, 1, D]
        sin = sin[positions].unsqueeze(1).to(qkv.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        write_kv(k, v, key_cache, value_cache, slot_mapping, key_scales, value_scales)
        return q

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

