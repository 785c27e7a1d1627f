"""Continuous-batching scheduler: every step it re-plans which requests run and how many
tokens each computes, within a token budget and the KV blocks available.

Pure Python, no torch. Prefill, chunked prefill, decode and a resumed preempted request are
the same case: a request gets min(uncomputed tokens, remaining budget) tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from pagedllm.config import SchedulerConfig
from pagedllm.core.fair_queue import FairQueue
from pagedllm.core.kv_cache import KVCacheManager
from pagedllm.core.lora_slot_table import LoRASlotTable
from pagedllm.core.request import FinishReason, Request, RequestStatus
from pagedllm.core.step_records import (PLACEHOLDER, RunnerOutput, SampledToken,
                                         ScheduledRequest, SchedulerOutput)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up at admission
    prefix_cache_hits: int = 0  # of which found in the cache
    num_prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    num_generation_tokens: int = 0
    last_step_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 lora_slots: LoRASlotTable | None = None):
        """lora_slots: the model's adapter slots; a request with an adapter is admitted only
        when its adapter has (or can take) one."""
        self.config = config
        self.kv = kv_manager
        self.lora_slots = lora_slots
        self.waiting = FairQueue()
        self.running: list[Request] = []  # in admission order: the newest is last
        self.max_running_per_user: dict[str, int] = {}  # per-key max_concurrent
        self.admission_paused = False  # memory pressure: the engine sets it before each step
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()

    # -- queue changes --------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """Finish (or abort) a request in any state; its blocks are freed at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._count_running(request, -1)
            self._release_slot(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- planning -------------------------------------------------------------------------
    def schedule(self, ahead: bool = False) -> SchedulerOutput:
        """ahead: plan the next step while the one before it still runs (overlapped steps,
        engine/engine.py). A request that samples in that step has a pending token (its value
        is on the device: PLACEHOLDER in the plan); computed tokens advance here, at
        planning, not when results come back; nobody verifies proposals; and a request whose
        pending token is its last (max_tokens, the context) is not planned again."""
        out = SchedulerOutput(ahead=ahead)
        budget = self.config.max_num_batched_tokens
        if self.config.prefill_alone_tokens and not any(map(_decodes, self.running)):
            budget = self.config.prefill_alone_tokens
        budget = self._schedule_running(out, budget, ahead)
        self._admit_waiting(out, budget)
        for item in out.scheduled:
            self.waiting.charge(item.user, item.num_new_tokens)
            if ahead:
                request = self.requests[item.request_id]
                request.num_computed_tokens += item.num_new_tokens
                request.num_pending_tokens += item.samples
        self.stats.last_step_tokens = out.num_scheduled_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, ahead: bool) -> int:
        """Running requests first, oldest first; when blocks run out, preempt the newest
        request of the user furthest above its fair share. Returns the budget left."""
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.num_pending_tokens and _ends_with_pending(request):
                index += 1
                continue
            num_new = min(_num_tokens(request) - request.num_computed_tokens, budget)
            # Proposed tokens ride along with a decode token while budget and blocks allow;
            # they are the first thing dropped, before anyone is preempted.
            drafts = request.draft_token_ids[:budget - 1] if num_new == 1 and not ahead else []
            if drafts and self.kv.allocate_slots(request, 1 + len(drafts)):
                out.scheduled.append(self._plan(request, 1, drafts))
                budget -= 1 + len(drafts)
                index += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self._pick_victim(index)
                self.running.remove(victim)
                self._count_running(victim, -1)
                self._release_slot(victim)
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._plan(request, num_new))
                budget -= num_new
                index += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in fair order while budget, slots and blocks last. Not in
        a step that had to preempt: memory is short, admitting more would thrash. Under
        memory pressure (the engine says so) only into an empty batch, so the server still
        makes progress one request at a time."""
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs
               and not (self.admission_paused and self.running)):
            request = self.waiting.peek(self._user_may_run, self._adapter_may_run)
            if request is None:
                break
            cached_blocks, num_cached = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(request, num_new, cached_blocks):
                break
            self.waiting.pop(request)
            self._admit(request, num_cached)
            out.scheduled.append(self._plan(request, num_new))
            budget -= num_new

    def _plan(self, request: Request, num_new: int, drafts: list[int] = ()) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        known = request.all_token_ids[start:end]
        window_table = self.kv.window_block_table(request.request_id)
        return ScheduledRequest(
            request.request_id, FairQueue.user_of(request), start,
            (*known, *[PLACEHOLDER] * (num_new - len(known)), *drafts),
            self.kv.block_table(request.request_id), end == _num_tokens(request),
            None if window_table is None else tuple(window_table), len(drafts),
            -1 if request.lora_key is None else self.lora_slots.slot_of[request.lora_key],
            request.params.lora_scale)

    def _user_may_run(self, user: str) -> bool:
        cap = self.max_running_per_user.get(user)
        return cap is None or self.waiting.num_running.get(user, 0) < cap

    def _adapter_may_run(self, request: Request) -> bool:
        return request.lora_key is None or self.lora_slots.can_acquire(request.lora_key)

    def _release_slot(self, request: Request) -> None:
        if request.lora_key is not None:
            self.lora_slots.release(request.lora_key)

    def _count_running(self, request: Request, delta: int) -> None:
        self.waiting.count_running(FairQueue.user_of(request), delta)

    def _pick_victim(self, protected: int) -> Request:
        """The newest running request of the user with the highest virtual time; requests
        before index `protected` are already scheduled this step and never taken. With one
        user this is plain newest-first."""
        candidates = self.running[protected:]
        vt = self.waiting.virtual_time
        worst_user = max((FairQueue.user_of(r) for r in candidates),
                         key=lambda u: vt.get(u, 0.0))
        return [r for r in candidates if FairQueue.user_of(r) == worst_user][-1]

    def _admit(self, request: Request, num_cached: int) -> None:
        if request.num_cached_tokens < 0:  # first admission, not a resume
            request.num_cached_tokens = num_cached
            request.first_scheduled_time = time.monotonic()
            self.stats.num_prompt_tokens += request.num_prompt_tokens
        self.stats.prefix_cache_queries += request.num_tokens
        self.stats.prefix_cache_hits += num_cached
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.RUNNING
        if request.lora_key is not None:
            self.lora_slots.acquire(request.lora_key)
        self.running.append(request)
        self._count_running(request, +1)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop its blocks; it waits at the front of the queue and
        usually finds its own prefix still cached when it comes back."""
        self.kv.free(request)
        request.draft_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- results --------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput
                           ) -> list[tuple[Request, list[SampledToken], int]]:
        """Advance each scheduled request past the tokens whose KV stays valid: all it
        computed, less the proposals that verification rejected, whose blocks go back
        (KVCacheManager.trim). Returns (request, its new tokens in order, proposals it
        verified) for each request that sampled. The engine appends the tokens one at a time
        (append_token), asking the output processor after each whether the request stops, and
        then finishes it here (finish_request): a stop may come before the last of them.
        A plan made ahead advanced its requests when it was made: here its sampled tokens
        stop being pending, also for a request preempted since (its token is real)."""
        updated = []
        for item in out.scheduled:
            request = self.requests.get(item.request_id)
            if request is None:  # finished between schedule and update
                continue
            tokens = result.sampled.get(item.request_id, [])
            if out.ahead:
                request.num_pending_tokens -= item.samples
            else:
                num_rejected = item.num_draft_tokens - max(0, len(tokens) - 1)
                request.num_computed_tokens += item.num_new_tokens - num_rejected
                if num_rejected:
                    self.kv.trim(request)
            if tokens:
                updated.append((request, tokens, item.num_draft_tokens))
        return updated

    def append_token(self, request: Request, sampled: SampledToken) -> None:
        request.append_token(sampled.token_id)
        if sampled.logprob is not None:
            request.logprobs.append(sampled.logprob)
        self.stats.num_generation_tokens += 1


def _num_tokens(request: Request) -> int:
    """Its known tokens and the one pending, if any (planned ahead)."""
    return request.num_tokens + request.num_pending_tokens


def _decodes(request: Request) -> bool:
    """Its client waits for its next token: its prompt is computed, or (preempted, now
    recomputing) it has answered already."""
    return request.num_computed_tokens >= request.num_prompt_tokens or request.num_output_tokens > 0


def _ends_with_pending(request: Request) -> bool:
    """Its pending token is its last: the output budget or the context ends there."""
    num_tokens = _num_tokens(request)
    return (num_tokens >= request.max_model_len or request.max_tokens is not None
            and num_tokens - request.num_prompt_tokens >= request.max_tokens)
