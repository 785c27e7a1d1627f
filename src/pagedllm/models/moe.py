"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE) in plain PyTorch.

The router scores every expert per token; each token goes to its top k, weighted by the
softmax of the scores (renormalized over the k where the model says so). A step's tokens are
grouped by expert, so each chosen expert runs one GEMM over all its tokens, whatever mix
of prefill and decode the step holds. That counting happens on the host; on a GPU a step
with no more (token, expert) pairs than experts runs its pairs there instead (moe_triton.py),
which a CUDA graph can capture. Shapes: T tokens, H hidden, E experts, I an expert's
intermediate size, k experts per token.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.model_config import ModelConfig


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, ops):
        super().__init__()
        num_experts, inter, hidden = (config.num_experts, config.expert_intermediate_size,
                                      config.hidden_size)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        # Filled by the loader (weights/fuse.py: fuse_experts): gate rows then up rows.
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden),
                                            requires_grad=False)
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden, inter),
                                         requires_grad=False)
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.ops = ops
        # The GPU's layer ops (Triton) can run a small step's pairs without the host
        # (moe_triton.py), so that a CUDA graph can capture it.
        self.routes_on_device = getattr(ops, "routes_experts_on_device", False)
        # Per expert, (gate_up, down) linear modules in place of the stacked parameters: the
        # bfloat16 model's 4-/8-bit experts from a GGUF, or its prepacked dense ones (build.py).
        self.expert_modules: list[tuple] | None = None

    def use_expert_modules(self, modules: list[tuple]) -> None:
        """Each expert's (gate_up, down) from now on; the stacked parameters are dropped."""
        self.expert_modules = modules
        del self.experts_gate_up, self.experts_down

    def _num_experts(self) -> int:
        return len(self.expert_modules) if self.expert_modules is not None else self.experts_down.shape[0]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H] -> (weights [T, k] in x's dtype, experts [T, k]); softmax in float32."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def max_device_tokens(self) -> int:
        """The most tokens a step may have for its (token, expert) pairs to run on the device,
        each reading its expert's matrices (moe_triton.py): no more pairs than experts, so
        no more reads than the grouped path's worst; 0 where that path is not available."""
        if not self.routes_on_device or self.expert_modules is not None:
            return 0
        return self._num_experts() // self.top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if 0 < x.shape[0] <= self.max_device_tokens():
            return self._pairs_on_device(x, weights, experts)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self._num_experts()).tolist()
        tokens = order // self.top_k
        slot_weights = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            if self.expert_modules is not None:
                gate_up, down = self.expert_modules[expert]
                y = down(self.ops.silu_and_mul(gate_up(x[rows])))
            else:
                hidden = self.ops.silu_and_mul(x[rows] @ self.experts_gate_up[expert].T)
                y = hidden @ self.experts_down[expert].T
            y = y * slot_weights[start:start + count, None]
            out.index_add_(0, rows, y)
            start += count
        return out

    def _pairs_on_device(self, x: torch.Tensor, weights: torch.Tensor,
                         experts: torch.Tensor) -> torch.Tensor:
        """Every (token, chosen expert) pair's MLP in one launch a matrix, nothing read back
        to the host: the graph-capturable path of a small step."""
        from pagedllm.models.moe_triton import expert_gemv

        pairs = experts.reshape(-1)
        hidden = self.ops.silu_and_mul(expert_gemv(x, self.experts_gate_up, pairs, self.top_k))
        y = expert_gemv(hidden, self.experts_down, pairs, 1)  # [T * k, H]
        return (y.view(x.shape[0], self.top_k, -1) * weights.unsqueeze(-1)).sum(dim=1)
