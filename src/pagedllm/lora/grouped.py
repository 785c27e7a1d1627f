"""The adapters' products for a whole step at once, over every slot its tokens use.

Punica's and S-LoRA's point: a step that mixes requests for many adapters reads the base
weights once, and the adapters' low-rank products are computed per segment of the batch by
one grouped operation, not by one pass of the model per adapter. Here the segments are the
tokens of each slot present in the step, gathered into a [slots, longest, in] block
(SGMV's shape) and multiplied by each slot's A and B with two batched matmuls: the same
handful of operations for one adapter or eight. Where the slots' token counts are very
uneven (a long prompt for one adapter beside single decode tokens of others) the padding
would cost more than it saves, and each slot's tokens are multiplied on their own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Padded (grouped) when the block holds at most this many times the tokens it serves.
MAX_PADDING_RATIO = 2.0


@dataclass
class LoRABatch:
    """Which tokens of a step run with which slot, as tensors the products index with.

    slots [U]: the slots present; index [U * longest]: each block row's token (padding rows
    point at token 0 and carry scale 0); scales [U, longest, 1]: llama.cpp's per-request
    scale (1 by default, 0 on padding). groups: (slot, token indices, their scales) per slot,
    for the ungrouped form."""

    slots: torch.Tensor
    index: torch.Tensor
    scales: torch.Tensor
    longest: int
    groups: list[tuple[int, torch.Tensor, torch.Tensor]]
    grouped: bool

    @classmethod
    def build(cls, token_slots: list[int], token_scales: list[float],
              device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
              ) -> LoRABatch | None:
        """token_slots: each token's slot, -1 for the base model; None when no token has
        an adapter (the step is the base model's alone)."""
        by_slot: dict[int, list[int]] = {}
        for token, slot in enumerate(token_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(token)
        if not by_slot:
            return None
        slots = sorted(by_slot)
        longest = max(len(by_slot[s]) for s in slots)
        served = sum(len(t) for t in by_slot.values())
        index, scales = [], []
        for slot in slots:
            tokens = by_slot[slot]
            pad = longest - len(tokens)
            index += tokens + [0] * pad
            scales += [token_scales[t] for t in tokens] + [0.0] * pad
        groups = [(slot, torch.tensor(by_slot[slot], device=device),
                   torch.tensor([token_scales[t] for t in by_slot[slot]], dtype=dtype,
                                device=device).unsqueeze(1)) for slot in slots]
        return cls(torch.tensor(slots, device=device), torch.tensor(index, device=device),
                   torch.tensor(scales, dtype=dtype, device=device).view(len(slots), longest, 1),
                   longest, groups, len(slots) * longest <= MAX_PADDING_RATIO * served)


def add_lora(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
             batch: LoRABatch) -> torch.Tensor:
    """y [T, out] += scale_t * (x_t @ A[slot_t].T) @ B[slot_t].T for every token with a slot.
    x [T, in]; a_stack [slots, rank, in]; b_stack [slots, out, rank] (scales folded in)."""
    if batch.grouped:
        num_slots, longest = batch.slots.shape[0], batch.longest
        xs = x.index_select(0, batch.index).view(num_slots, longest, -1)
        a = a_stack.index_select(0, batch.slots)
        b = b_stack.index_select(0, batch.slots)
        delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2)) * batch.scales
        return y.index_add_(0, batch.index, delta.view(num_slots * longest, -1).to(y.dtype))
    for slot, tokens, scales in batch.groups:
        delta = (x.index_select(0, tokens) @ a_stack[slot].T) @ b_stack[slot].T * scales
        y.index_add_(0, tokens, delta.to(y.dtype))
    return y


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor,
                       b_stack: torch.Tensor, token_slots: list[int],
                       token_scales: list[float]) -> torch.Tensor:
    """Token by token, in float32: the oracle the grouped forms are tested against."""
    out = y.float().clone()
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            h = a_stack[slot].float() @ x[t].float()
            out[t] += token_scales[t] * (b_stack[slot].float() @ h)
    return out.to(y.dtype)
