"""One model step between its launch and its results (ModelRunner.launch / sample / collect).

Apart so that the engine can overlap steps: step t+1 is planned and its model call made
while step t's sampled ids are still on the device (vLLM's async scheduling). The host
waits for them once a step, when it collects them, after the next step is already queued.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.backends.host_values import to_device
from pagedllm.core.step_records import SchedulerOutput


@dataclass
class SampledRows:
    """One sampling of some of the step's logits rows: the request of each row, the logits
    (for the logprobs), the rows' sampling state, and the chosen ids where they were drawn."""

    request_ids: list[str]
    logits: torch.Tensor
    rows: list
    token_ids: torch.Tensor


@dataclass
class LaunchedStep:
    plan: SchedulerOutput
    sampled_ids: list[str] = field(default_factory=list)  # the request of each logits row
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    logits: torch.Tensor | None = None  # [sampled rows, vocab]: on a GPU, still being computed
    error: str | None = None  # the whole step failed (every request in it fails)
    draws: list[SampledRows] = field(default_factory=list)  # after sample()
    failed: dict[str, str] = field(default_factory=dict)  # requests whose sampling failed

    def tokens_for(self, request_ids: list[str], device) -> torch.Tensor:
        """The token each request sampled here, where it was sampled, without waiting for it
        (the next step's PLACEHOLDER inputs). A request whose sampling failed gets 0: it
        fails when this step is collected, and the row computed with it is never read."""
        row_of, offset = {}, 0
        for draw in self.draws:
            for i, rid in enumerate(draw.request_ids):
                row_of[rid] = offset + i  # a verifying request's last row (never ahead)
            offset += len(draw.request_ids)
        tokens = torch.cat([*(d.token_ids.to(device) for d in self.draws),
                            torch.zeros(1, dtype=torch.long, device=device)])
        rows = [row_of.get(rid, offset) for rid in request_ids]  # offset: the zero row
        return tokens[to_device(rows, torch.long, device)]
