"""The model's LoRA slots: per decoder layer and fused projection, the A and B of every slot
stacked ([slots, rank, in] and [slots, out, rank], zero where a slot or part is empty), and
each projection wrapped so that it adds the step's adapter products to the base's output.

Which slot holds which adapter is the scheduler's bookkeeping (core/lora_slots.py); the model
runner copies an adapter's weights into its slot before the first step that uses it
(`load`), and hands each step's token-to-slot mapping to `set_batch`. The projections share
this object and read the mapping from it, as vLLM's LoRA layers read their punica wrapper:
the mapping is the step's, set once, for dozens of modules that are called with x alone.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.config import LoRAConfig, ModelConfig
from pagedllm.lora.adapter import FUSED_PARTS, MODULE_OWNER, LoRAAdapter, fused_shapes
from pagedllm.lora.grouped import LoRABatch, add_lora


class LoRAProjection(nn.Module):
    """base(x), plus the adapters' products for the tokens of this step that have one."""

    def __init__(self, base, a_stack: torch.Tensor, b_stack: torch.Tensor, slots: LoRASlots):
        super().__init__()
        self.base = base
        self.a_stack, self.b_stack = a_stack, b_stack
        self.slots = slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.slots.batch
        if batch is None:
            return y
        return add_lora(y, x, self.a_stack, self.b_stack, batch)


class LoRASlots:
    def __init__(self, model, config: ModelConfig, lora: LoRAConfig, dtype: torch.dtype,
                 device: str = "cpu"):
        """Wraps the model's projections (in place) with slots for lora.max_loras adapters
        of rank up to lora.max_lora_rank per part."""
        self.num_slots, self.max_rank = lora.max_loras, lora.max_lora_rank
        self.dtype, self.device = dtype, device
        self.batch: LoRABatch | None = None
        self.contents: list[str | None] = [None] * self.num_slots  # adapter key per slot
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        shapes = fused_shapes(config)
        for index, layer in enumerate(model.layers):
            for fused, owner in MODULE_OWNER.items():
                parent = getattr(layer, owner)
                if not hasattr(parent, fused):  # a mixture of experts' MLP
                    continue
                fan_in, fan_out = shapes[fused]
                rank = self.max_rank * len(FUSED_PARTS[fused])
                a = torch.zeros(self.num_slots, rank, fan_in, dtype=dtype, device=device)
                b = torch.zeros(self.num_slots, fan_out, rank, dtype=dtype, device=device)
                self.stacks[(index, fused)] = (a, b)
                setattr(parent, fused, LoRAProjection(getattr(parent, fused), a, b, self))

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.stacks.values())

    @staticmethod
    def bytes_for(config: ModelConfig, lora: LoRAConfig, element_size: int) -> int:
        """What the slots take (plan counts it before anything is built)."""
        total = 0
        for fused, (fan_in, fan_out) in fused_shapes(config).items():
            if config.num_experts and MODULE_OWNER[fused] == "mlp":
                continue
            total += lora.max_lora_rank * len(FUSED_PARTS[fused]) * (fan_in + fan_out)
        return total * lora.max_loras * config.num_layers * element_size

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """The adapter's weights into the slot (the rest of the slot zeroed)."""
        if self.contents[slot] == adapter.key:
            return
        for (layer, fused), (a, b) in self.stacks.items():
            a[slot].zero_()
            b[slot].zero_()
            weights = adapter.modules.get((layer, fused))
            if weights is not None:
                a[slot, :weights.rank].copy_(weights.a)
                b[slot, :, :weights.rank].copy_(weights.b)
        self.contents[slot] = adapter.key

    def set_batch(self, token_slots: list[int], token_scales: list[float]) -> None:
        self.batch = LoRABatch.build(token_slots, token_scales, self.device, self.dtype)

    @property
    def active(self) -> bool:
        """This step has tokens with an adapter (the fused decode paths then stand aside)."""
        return self.batch is not None
