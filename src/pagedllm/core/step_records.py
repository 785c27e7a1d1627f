"""The messages of one engine step, as plain records: the scheduler's plan for the model
runner (SchedulerOutput) and the runner's result (RunnerOutput).

Nothing here points at a live Request: the runner reads only what the plan says, and the
plan cannot change under it while the engine updates requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from pagedllm.core.request import TokenLogprob

# A plan's token that is not known yet when it is made (overlapped steps): the token its
# request samples in the step before, which the model runner takes from that step's sampled
# ids where they are (on the device) without waiting for them.
PLACEHOLDER = -1


class ScheduledRequest(NamedTuple):
    """One request's share of a step: compute `token_ids` at positions start, start+1, ...
    into the blocks of `block_table`; `samples` when the last of them is the request's last
    known token, so a new token is sampled from its logits. With num_draft_tokens > 0 the
    request decodes speculatively: token_ids is its last known token and then that many
    proposed ones, each position is sampled, and the proposals are kept up to the first that
    differs from what was sampled before it (engine/verify.py).

    A NamedTuple, not a frozen dataclass: one is made per request per step, and a frozen
    dataclass's __init__ (a setattr through object per field) cost ~5.7 us against ~0.4 us,
    1.5 ms a step at 256 requests."""

    request_id: str
    user: str
    start: int
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    samples: bool
    # The sliding-window layers' blocks (their own group), where the model has such layers.
    window_block_table: tuple[int, ...] | None = None
    num_draft_tokens: int = 0
    lora_slot: int = -1  # the slot of its LoRA adapter (core/lora_slot_table.py); -1: the base
    lora_scale: float = 1.0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids, newest victim last
    # Made while the step before still ran (Scheduler.schedule(ahead=True)): its requests
    # advanced at planning, and a PLACEHOLDER token is the one that step samples.
    ahead: bool = False

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


@dataclass
class RunnerOutput:
    """What one step of the model produced: the tokens of each request that sampled (one, or
    up to 1 + its proposals when it verified some), and why for each request whose sampling
    failed (only those fail; the step went on)."""

    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
