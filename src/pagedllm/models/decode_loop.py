"""Every decoder layer of a decode step in one C++ call (kernels/decode_layers.h).

Each op of a layer already runs in C++, but driving them from Python cost ~40 us a layer of
interpreter and nn.Module overhead, about a third of a one-token step on the default model.
The C++ loop calls the same functions in the same order, so its output is bit-identical to
the Python layers'. It applies when the model runs the fast bfloat16 path throughout (every
projection on pagedllm's low-bit kernels without bias: 4-bit, Q6_K, Q8_0, or parts of those
side by side as a Q4_K_M file's q/k/v; the fused C++ layer ops, the C++ decode attention) and
the step holds decode tokens only, no more than the 4-bit kernels take. models/build.py
decides whether it applies and gives it the layers' weights. With LoRA slots (lora/slots.py,
`lora`), a step whose tokens use adapters adds their products after each projection inside
the loop too, through the same kernel as the Python layers' (kernels/lora_sgmv.cpp).
"""
from __future__ import annotations

import torch

from pagedllm.attention import AttentionMetadata, LayerKVCache
from pagedllm.models.quant_linear import ALL_ROWS


class DecodeLoop:
    def __init__(self, ops, weights: list[list[torch.Tensor]], cos: torch.Tensor, sin: torch.Tensor,
                 num_heads: int, eps: float, scale: float, max_rows: int,
                 exact_max_rows: list[int], amx_min_rows: int = ALL_ROWS,
                 int16_max_rows: int = 0):
        self.ops = ops
        self.weights = weights
        self.cos, self.sin = cos, sin
        self.num_heads, self.eps, self.scale = num_heads, eps, scale
        self.max_rows = max_rows  # the projections' rows on 4-bit codes
        self.exact_max_rows = exact_max_rows  # per layer: and exactly (QuantLinear's)
        self.amx_min_rows = amx_min_rows  # exact products on the AMX tiles from (QuantLinear's)
        self.int16_max_rows = int16_max_rows  # 16-bit integer activations up to (QuantLinear's)
        self.lora = None  # the model's LoRA slots, once attached (LoRASlots.attach_to_loop)

    def applies(self, meta: AttentionMetadata, tokens: int) -> bool:
        batch = meta.decode_batch()
        return batch is not None and len(batch.rows) == tokens and tokens <= self.max_rows

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[LayerKVCache],
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedded tokens [T, H] -> (last MLP output, residual), as the Python layers return."""
        batch = meta.decode_batch()
        quantized = kv_caches[0].quantized
        exact_max_rows, amx_min_rows = self.exact_max_rows, self.amx_min_rows
        int16_max_rows = self.int16_max_rows
        if meta.num_requests is not None and meta.num_requests < len(batch.rows):
            # Verifying proposals: exact, 16-bit or int8-rounded activations, on the AMX
            # tiles or not, as a plain decode step of these requests would have them, so the
            # tokens kept are the ones plain decoding gives, bit for bit.
            exact_max_rows = [ALL_ROWS if meta.num_requests <= rows else 0
                              for rows in exact_max_rows]
            amx_min_rows = 0 if meta.num_requests >= amx_min_rows else ALL_ROWS
            int16_max_rows = ALL_ROWS if meta.num_requests <= int16_max_rows else 0
        hidden, residual = self.ops.decode_layers(
            hidden, positions, self.cos, self.sin, self.weights, [kv.key for kv in kv_caches],
            [kv.value for kv in kv_caches], [kv.key_scale for kv in kv_caches] if quantized else [],
            [kv.value_scale for kv in kv_caches] if quantized else [], meta.slot_mapping,
            batch.block_tables, batch.seq_lens, self.num_heads, self.eps, self.scale,
            exact_max_rows, amx_min_rows, int16_max_rows, *self._lora_args())
        return hidden, residual

    def _lora_args(self) -> tuple:
        lora = self.lora
        if lora is None or lora.batch is None:
            return [], [], None, None
        return (lora.loop_stacks, lora.loop_part_starts, lora.batch.token_slots,
                lora.batch.token_scales)
