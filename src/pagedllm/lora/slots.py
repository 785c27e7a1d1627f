"""The model's LoRA slots: per decoder layer and fused projection of P parts, the A and B of
every slot stacked, A [slots, P*rank, in] (each part's rows) and B [slots, rank, out] (each
part's B transposed, in its own output columns: no block of zeros between parts), zero where
a slot or part is empty; and each projection wrapped so that it adds the step's adapter
products to the base's output (grouped.py).

Which slot holds which adapter is the scheduler's bookkeeping (core/lora_slot_table.py); the model
runner copies an adapter's weights into its slot before the first step that uses it
(`load`), and hands each step's token-to-slot mapping to `set_batch`. The projections share
this object and read the mapping from it, as vLLM's LoRA layers read their punica wrapper:
the mapping is the step's, set once, for dozens of modules that are called with x alone.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from pagedllm.config import LoRAConfig
from pagedllm.model_config import ModelConfig
from pagedllm.lora.adapter import FUSED_PARTS, MODULE_OWNER, LoRAAdapter, part_shapes
from pagedllm.lora.grouped import LoRABatch, add_lora


class LoRAProjection(nn.Module):
    """base(x), plus the adapters' products for the tokens of this step that have one."""

    def __init__(self, base, a_stack: torch.Tensor, b_stack: torch.Tensor,
                 part_starts: tuple[int, ...], slots: LoRASlots):
        super().__init__()
        self.base = base
        self.a_stack, self.b_stack, self.part_starts = a_stack, b_stack, part_starts
        self.slots = slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.slots.batch
        if batch is None:
            return y
        return add_lora(y, x, self.a_stack, self.b_stack, self.part_starts, batch,
                        self.slots.kernels)


class LoRASlots:
    def __init__(self, model, config: ModelConfig, lora: LoRAConfig, dtype: torch.dtype,
                 device: str = "cpu", kernels=None):
        """Wraps the model's projections (in place) with slots for lora.max_loras adapters
        of rank up to lora.max_lora_rank per part. kernels: the backend's C++ kernels, which
        compute each projection's products in one call (None: torch's ops). On a GPU the
        Triton kernels do (triton_sgmv.py)."""
        self.num_slots, self.max_rank = lora.max_loras, lora.max_lora_rank
        self.kernels = kernels if device == "cpu" else _triton_kernels(device)
        self.dtype, self.device = dtype, device
        self.batch: LoRABatch | None = None
        self.contents: list[str | None] = [None] * self.num_slots  # adapter key per slot
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, tuple]] = {}
        parts = part_shapes(config)
        rank = self.max_rank
        for index, layer in enumerate(model.layers):
            for fused, owner in MODULE_OWNER.items():
                parent = getattr(layer, owner)
                if not hasattr(parent, fused):  # a mixture of experts' MLP
                    continue
                names = FUSED_PARTS[fused]
                starts = tuple(itertools.accumulate((parts[n][1] for n in names), initial=0))
                fan_in = parts[names[0]][0]
                a = torch.zeros(self.num_slots, len(names) * rank, fan_in, dtype=dtype,
                                device=device)
                b = torch.zeros(self.num_slots, rank, starts[-1], dtype=dtype, device=device)
                self.stacks[(index, fused)] = (a, b, starts)
                setattr(parent, fused, LoRAProjection(getattr(parent, fused), a, b, starts, self))

    def attach_to_loop(self, loop) -> bool:
        """Give the C++ decode loop (models/decode_loop.py) the stacks in its order, so
        decode steps with adapters stay in the loop; False where it cannot take them (the
        torch forms, or a layer without all four projections wrapped)."""
        names = tuple(MODULE_OWNER)
        layers = {layer for layer, _ in self.stacks}
        if self.device != "cpu" or self.kernels is None or any((layer, name) not in self.stacks
                                       for layer in layers for name in names):
            return False
        self.loop_stacks = [t for layer in sorted(layers) for name in names
                            for t in self.stacks[(layer, name)][:2]]
        self.loop_part_starts = [list(self.stacks[(0, name)][2]) for name in names]
        loop.lora = self
        return True

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b, _ in self.stacks.values())

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """The adapter's weights into the slot (the rest of the slot zeroed)."""
        if self.contents[slot] == adapter.key:
            return
        rank = self.max_rank
        for (layer, fused), (a, b, starts) in self.stacks.items():
            a[slot].zero_()
            b[slot].zero_()
            weights = adapter.modules.get((layer, fused))
            for p, part in enumerate(weights.parts if weights is not None else ()):
                if part is not None:
                    part_a, part_b = part
                    r = part_a.shape[0]
                    a[slot, p * rank:p * rank + r].copy_(part_a)
                    b[slot, :r, starts[p]:starts[p + 1]].copy_(part_b.T)
        self.contents[slot] = adapter.key

    def set_batch(self, token_slots: list[int], token_scales: list[float]) -> None:
        self.batch = LoRABatch.build(token_slots, token_scales, self.device, self.dtype,
                                     torch_forms=self.kernels is None)

    @property
    def active(self) -> bool:
        """This step has tokens with an adapter (the fused decode paths then stand aside)."""
        return self.batch is not None


def _triton_kernels(device: str):
    if device != "cuda":
        return None
    from pagedllm.lora.triton_sgmv import TritonLoRA

    return TritonLoRA()
