"""The adapters' products for a whole step at once, over every slot its tokens use.

Punica's and S-LoRA's point: a step that mixes requests for many adapters reads the base
weights once, and the adapters' low-rank products are computed per segment of the batch by
one grouped operation, not by one pass of the model per adapter.

The slots' layout (slots.py): per fused projection of P parts (q, k, v: 3), A [slots, P*r,
in] holds every part's A rows, and B [slots, r, out] each part's B, transposed, in that
part's output columns. So h = x @ A[slot].T is one product for all parts, and part p's
output columns get h[:, p*r:(p+1)*r] @ B[slot][:, its columns].

On the CPU with pagedllm's C++ kernels the whole step is one call a projection
(kernels/lora_sgmv.cpp). The torch forms serve the generic backend (a GPU) and CPUs without
the kernels: the tokens of each slot gathered into a [slots, longest, in] block (SGMV's
shape) and multiplied with batched matmuls, the same few operations for one adapter or
eight; where the slots' token counts are very uneven (a long prompt beside single decode
tokens) the padding would cost more than it saves, and each slot's tokens go on their own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Padded (grouped) when the block holds at most this many times the tokens it serves.
MAX_PADDING_RATIO = 2.0


@dataclass
class LoRABatch:
    """Which tokens of a step run with which slot, as tensors the products index with.

    token_slots [T] / token_scales [T]: each token's slot (-1: the base) and scale (the C++
    kernel's). For the torch forms: slots [U], the slots present; index [U * longest], each
    block row's token (padding rows point at token 0 and carry scale 0); scales [U, longest,
    1]; groups: (slot, token indices, their scales) per slot."""

    token_slots: torch.Tensor
    token_scales: torch.Tensor
    slots: torch.Tensor | None
    index: torch.Tensor | None
    scales: torch.Tensor | None
    longest: int
    groups: list[tuple[int, torch.Tensor, torch.Tensor]]
    grouped: bool

    @classmethod
    def build(cls, token_slots: list[int], token_scales: list[float],
              device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
              torch_forms: bool = True) -> LoRABatch | None:
        """token_slots: each token's slot, -1 for the base model; None when no token has
        an adapter (the step is the base model's alone). torch_forms=False: only what a
        kernel reads (token_slots, token_scales), not the torch forms' indices."""
        by_slot: dict[int, list[int]] = {}
        for token, slot in enumerate(token_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(token)
        if not by_slot:
            return None
        per_token = (torch.tensor(token_slots, dtype=torch.long, device=device),
                     torch.tensor(token_scales, dtype=torch.float32, device=device))
        if not torch_forms:
            return cls(*per_token, None, None, None, 0, [], False)
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
        return cls(*per_token, torch.tensor(slots, device=device), torch.tensor(index, device=device),
                   torch.tensor(scales, dtype=dtype, device=device).view(len(slots), longest, 1),
                   longest, groups, len(slots) * longest <= MAX_PADDING_RATIO * served)


def add_lora(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
             part_starts: tuple[int, ...], batch: LoRABatch, kernels=None) -> torch.Tensor:
    """y [T, out] += each token's adapter products, in place. x [T, in]; a_stack
    [slots, P*r, in]; b_stack [slots, r, out]; part_starts: the P parts' first output
    columns and the end ([0, q, q+kv, out] for q/k/v). kernels: pagedllm's C++ kernels (one
    call), None for the torch forms."""
    if kernels is not None:
        y = y.contiguous()
        kernels.lora_add(y, x.contiguous(), a_stack, b_stack, batch.token_slots,
                         batch.token_scales, list(part_starts))
        return y
    rank = b_stack.shape[1]
    if batch.grouped:
        num_slots, longest = batch.slots.shape[0], batch.longest
        xs = x.index_select(0, batch.index).view(num_slots, longest, -1)
        h = torch.bmm(xs, a_stack.index_select(0, batch.slots).transpose(1, 2))
        b = b_stack.index_select(0, batch.slots)
        delta = torch.cat([torch.bmm(h[..., p * rank:(p + 1) * rank], b[..., start:end])
                           for p, (start, end) in enumerate(zip(part_starts, part_starts[1:]))],
                          dim=-1) * batch.scales
        return y.index_add_(0, batch.index, delta.view(num_slots * longest, -1).to(y.dtype))
    for slot, tokens, scales in batch.groups:
        h = x.index_select(0, tokens) @ a_stack[slot].T
        delta = torch.cat([h[:, p * rank:(p + 1) * rank] @ b_stack[slot, :, start:end]
                           for p, (start, end) in enumerate(zip(part_starts, part_starts[1:]))],
                          dim=-1) * scales
        y.index_add_(0, tokens, delta.to(y.dtype))
    return y


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor,
                       b_stack: torch.Tensor, part_starts: tuple[int, ...],
                       token_slots: list[int], token_scales: list[float]) -> torch.Tensor:
    """Token by token and part by part, in float32: the oracle of the other forms."""
    out = y.float().clone()
    rank = b_stack.shape[1]
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        h = a_stack[slot].float() @ x[t].float()
        for p, (start, end) in enumerate(zip(part_starts, part_starts[1:])):
            part = b_stack[slot, :, start:end].float().T @ h[p * rank:(p + 1) * rank]
            out[t, start:end] += token_scales[t] * part
    return out.to(y.dtype)
