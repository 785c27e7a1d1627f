"""Every decoder layer of a decode step in one C++ call (kernels/decode_layers.cpp).

Each op of a layer already runs in C++, but driving them from Python cost ~40 us a layer of
interpreter and nn.Module overhead, about a third of a one-token step on the default model.
The C++ loop calls the same functions in the same order, so its output is bit-identical to
the Python layers'. It applies when the model runs the fast bfloat16 path throughout (every
projection a QuantLinear on pagedllm's 4-bit kernels without bias, the fused C++ layer ops,
the C++ decode attention) and the step holds decode tokens only, no more than the 4-bit
kernels take (all where q4_q8_gemm is built).
"""
from __future__ import annotations

import torch

from pagedllm.attention import AttentionMetadata, LayerKVCache
from pagedllm.attention.batched import BatchedBackend
from pagedllm.kernels import kernel_ops
from pagedllm.models.quant_linear import QuantLinear


class DecodeLoop:
    def __init__(self, ops, weights: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 num_heads: int, eps: float, scale: float, max_rows: int,
                 exact_max_rows: list[int]):
        self.ops = ops
        self.weights = weights
        self.cos, self.sin = cos, sin
        self.num_heads, self.eps, self.scale = num_heads, eps, scale
        self.max_rows = max_rows  # the projections' rows on 4-bit codes
        self.exact_max_rows = exact_max_rows  # per layer: and exactly (QuantLinear's)

    @classmethod
    def build(cls, model) -> DecodeLoop | None:
        """The loop for a loaded model, or None where some layer is off the fast path."""
        ops = kernel_ops()
        if ops is None or model.dtype != torch.bfloat16:
            return None
        weights, max_rows, exact_max_rows = [], [], []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(p, QuantLinear) and p.q4_ops is not None and p.bias is None
                       for p in projections):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(m.ops is not ops for m in (*norms, attn, mlp)):
                return None
            if not isinstance(attn.backend, BatchedBackend) or attn.backend.kernel is None:
                return None
            weights += [layer.input_layernorm.weight, attn.qkv_proj.packed, attn.o_proj.packed,
                        layer.post_attention_layernorm.weight, mlp.gate_up_proj.packed,
                        mlp.down_proj.packed]
            max_rows += [p.max_rows for p in projections]
            exact = {p.exact_max_rows for p in projections}
            if len(exact) != 1:
                return None  # the C++ loop takes one row limit per layer
            exact_max_rows += exact
        first = model.layers[0]
        return cls(ops, weights, first.self_attn.rotary.cos, first.self_attn.rotary.sin,
                   first.self_attn.num_heads, first.input_layernorm.eps,
                   first.self_attn.backend.scale, min(max_rows), exact_max_rows)

    def applies(self, meta: AttentionMetadata, tokens: int) -> bool:
        batch = meta.decode_batch()
        return batch is not None and len(batch.rows) == tokens and tokens <= self.max_rows

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[LayerKVCache],
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedded tokens [T, H] -> (last MLP output, residual), as the Python layers return."""
        batch = meta.decode_batch()
        quantized = kv_caches[0].quantized
        hidden, residual = self.ops.decode_layers(
            hidden, positions, self.cos, self.sin, self.weights, [kv.key for kv in kv_caches],
            [kv.value for kv in kv_caches], [kv.key_scale for kv in kv_caches] if quantized else [],
            [kv.value_scale for kv in kv_caches] if quantized else [], meta.slot_mapping,
            batch.block_tables, batch.seq_lens, self.num_heads, self.eps, self.scale,
            self.exact_max_rows)
        return hidden, residual
