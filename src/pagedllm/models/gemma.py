"""Gemma 2's decoder layer: norms around the attention and around the MLP ("sandwich"), and a
GeGLU MLP (tanh gelu). Norm weights arrive as (1 + w), so the usual RMSNorm applies them.

The residual stream is carried as in llama.py's DecoderLayer (the adds fused into the norms
that follow them), so both kinds of layer chain the same way."""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from pagedllm.model_config import ModelConfig


class GegluMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class SandwichDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: nn.Module, norm):
        super().__init__()
        self.input_layernorm = norm()
        self.self_attn = attention
        self.post_attention_layernorm = norm()  # on the attention's output
        self.pre_feedforward_layernorm = norm()
        self.mlp = GegluMLP(config)
        self.post_feedforward_layernorm = norm()  # on the MLP's output

    def forward(self, positions, hidden, residual, kv_cache, meta):
        """Returns (this layer's normed MLP output, the residual stream before adding it)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, meta))
        hidden = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual
