"""Speculative decoding's bookkeeping: which tokens to propose for a request's next step, how
many, and the acceptance figures. Pure Python, no torch.

A running request in decode gets k proposed tokens (`Request.draft_token_ids`); the scheduler
plans them with its last token, the runner verifies all k + 1 positions in one forward pass
and keeps the proposals up to the first one the model would not have produced, plus the token
the model produced there (engine/verify.py). So a step yields 1 to k + 1 tokens for one read
of the weights, and the output is the one decoding without proposals gives.

Proposals are n-gram ones made here (prompt lookup, as vLLM's `ngram` method and llama.cpp's
lookup decoding: the request's longest recent n-gram that occurred before in its prompt or
answer, and the tokens that followed it there; no model, they win where the answer quotes
its input), or a draft model's (engine/draft_proposer.py, behind the DraftModel protocol).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import Request


class NgramIndex:
    """Where each token occurred in one request's tokens, grown as the request grows, so a
    proposal looks only at the occurrences of its last token (the newest `max_candidates`),
    not at the whole context."""

    def __init__(self, max_candidates: int = 64):
        self.positions: dict[int, list[int]] = {}
        self.num_indexed = 0
        self.max_candidates = max_candidates

    def propose(self, tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
        """Up to k tokens that followed the newest earlier occurrence of the sequence's last
        n tokens, for the largest n <= max_n that occurred (at least min_n); [] if none."""
        length = len(tokens)
        # Every position but the last is a place a match may end (the last is the tail itself).
        for i in range(self.num_indexed, length - 1):
            self.positions.setdefault(tokens[i], []).append(i)
        self.num_indexed = max(self.num_indexed, length - 1)
        if k < 1 or length < 2:
            return []
        ends = self.positions.get(tokens[-1], ())
        best_end, best_n = -1, 0
        for end in reversed(ends[-self.max_candidates:]):
            n = 1
            while n < max_n and end - n >= 0 and tokens[end - n] == tokens[length - 1 - n]:
                n += 1
            if n > best_n:
                best_end, best_n = end, n
                if n == max_n:
                    break
        if best_n < min_n:
            return []
        return tokens[best_end + 1:best_end + 1 + k]


@dataclass
class SpeculationState:
    """One request's adaptive proposal length and where its tokens occurred."""

    k: int
    index: NgramIndex = field(default_factory=NgramIndex)

    def record(self, num_proposed: int, num_accepted: int, k_max: int) -> None:
        """After a verification: every proposal accepted grows k by one; a rejection sets it
        to what was accepted plus one, so a request whose proposals miss costs one extra row
        a step, and one that quotes its input runs at the longest proposals."""
        if num_accepted == num_proposed:
            self.k = min(k_max, self.k + 1)
        else:
            self.k = max(1, num_accepted + 1)


@dataclass
class SpeculationStats:
    """Totals over the engine's life (vLLM's spec_decode counters): what /metrics exports."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position += [0] * (num_proposed - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens per verification step (accepted proposals plus the model's own)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class DraftModel(Protocol):
    """Proposals from a draft model (engine/draft_proposer.py; torch, so not imported here)."""

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]: ...

    def forget(self, request_id: str) -> None: ...


class Speculator:
    """Sets each decoding request's proposals for the next step (Request.draft_token_ids)
    and learns from what verification accepted."""

    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None = None):
        """draft: the draft model's proposer, where the server has one (method "draft")."""
        self.config = config
        self.draft = draft
        self.states: dict[str, SpeculationState] = {}
        self.stats = SpeculationStats()

    def method(self, request: Request) -> str:
        """The request's own choice (an extension field), else the server's default."""
        return request.params.speculative or self.config.method

    def propose(self, running: list[Request]) -> None:
        """Proposals for the running requests that decode next step, oldest first, within
        the step's row budget; none at all when the batch is large."""
        config = self.config
        for request in running:
            request.draft_token_ids = []
        if len(running) >= config.max_batch_sequences:
            return
        rows_left = config.max_rows - len(running)
        from_draft = []
        for request in running:
            if rows_left <= 0:
                break
            method = self.method(request)
            if request.num_tokens - request.num_computed_tokens != 1 or method == "off":
                continue
            state = self.states.get(request.request_id)
            if state is None:
                state = self.states[request.request_id] = SpeculationState(config.num_speculative_tokens)
            k = min(state.k, rows_left, request.max_model_len - request.num_tokens)
            if request.max_tokens is not None:  # a step yields up to k + 1 tokens
                k = min(k, request.max_tokens - request.num_output_tokens - 1)
            if k < 1:
                continue
            if method == "draft":
                from_draft.append((request, k))
                rows_left -= k
                continue
            drafts = state.index.propose(request.all_token_ids, k, config.prompt_lookup_max,
                                         config.prompt_lookup_min)
            request.draft_token_ids = drafts
            rows_left -= len(drafts)
        if from_draft and self.draft is not None:
            proposals = self.draft.propose(from_draft)
            for request, _ in from_draft:
                request.draft_token_ids = proposals.get(request.request_id, [])

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """What one verification of the request's proposals accepted."""
        if num_proposed == 0:
            return
        self.stats.record(num_proposed, num_accepted)
        state = self.states.get(request_id)
        if state is not None:
            state.record(num_proposed, num_accepted, self.config.num_speculative_tokens)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        if self.draft is not None:
            self.draft.forget(request_id)
