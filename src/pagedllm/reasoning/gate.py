"""The engine's gate on a thinking request's tokens, in the place of its grammar matcher
(the sampler reads it the same way): while the model thinks, every token is allowed, and once
the budget is spent only the end marker's tokens, one after another, so the model goes on to
answer; the request's grammar (structured output, a forced tool call) applies only to the
answer after the end marker, never to the thinking (vLLM does the same).

An answer that may open its own thinking (the prompt did not open it) may start with the
start marker or with what the grammar allows; which one it took decides the rest."""
from __future__ import annotations

import ctypes
from collections import deque

from pagedllm.core.thinking import ThinkingControl

OPENING, THINKING, ANSWER = "opening", "thinking", "answer"


class ThinkingGate:
    def __init__(self, control: ThinkingControl, grammar=None, eos_token_ids=()):
        self.control = control
        self.grammar = grammar  # the answer's GrammarMatcher, or None
        self.state = THINKING if control.inside else OPENING
        self.thinking_tokens = 0
        self._forced = 0  # end-marker tokens written by the budget so far
        self._recent: deque[int] = deque(maxlen=len(control.end_ids))
        self._eos = tuple(grammar.eos_token_ids if grammar is not None else eos_token_ids)

    # -- what the sampler reads ---------------------------------------------------------------
    @property
    def forced_token(self) -> int | None:
        """The end-marker token the budget writes next, once the budget is spent."""
        budget = self.control.budget
        if self.state != THINKING or budget is None or self.thinking_tokens < budget:
            return None
        return self.control.end_ids[min(self._forced, len(self.control.end_ids) - 1)]

    def allows(self, token_id: int) -> bool:
        forced = self.forced_token
        if forced is not None:
            return token_id == forced
        if self.state == THINKING:
            return True
        if self.state == OPENING and token_id == self.control.start_ids[0]:
            return True
        return self.grammar is None or self.grammar.allows(token_id)

    def fill_mask(self, ptr: int, row_bytes: int) -> None:
        forced = self.forced_token
        if forced is not None:
            _allow(ptr, forced)
        elif self.state == THINKING or self.grammar is None:
            ctypes.memset(ptr, 0xFF, row_bytes)
        else:
            self.grammar.fill_mask(ptr, row_bytes)
            if self.state == OPENING:
                _allow(ptr, self.control.start_ids[0])

    @property
    def failed(self) -> bool:
        return self.state == ANSWER and self.grammar is not None and self.grammar.failed

    @property
    def error(self) -> str:
        return self.grammar.error if self.grammar is not None else ""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def masks_along(self, tokens: list[int], row_bytes: int) -> list:
        """Verification rows past the first read the gate itself (the server turns n-gram
        proposals off for every gated request: its masks change as the thinking ends and as
        a budget writes the marker); in the answer, the grammar's own masks."""
        if self.state == ANSWER and self.grammar is not None:
            return self.grammar.masks_along(tokens, row_bytes)
        return []

    # -- the token that came ------------------------------------------------------------------
    def accept(self, token_id: int) -> None:
        if self.state == OPENING:
            if token_id == self.control.start_ids[0]:
                self.state = THINKING
                self.thinking_tokens = 1
                return
            self.state = ANSWER
        if self.state == ANSWER:
            if self.grammar is not None:
                self.grammar.accept(token_id)
            return
        if self.forced_token is not None:
            self._forced += 1
        self.thinking_tokens += 1
        self._recent.append(token_id)
        if tuple(self._recent) == self.control.end_ids:
            self.state = ANSWER


def _allow(ptr: int, token_id: int) -> None:
    word = ctypes.c_uint32.from_address(ptr + token_id // 32 * 4)
    word.value |= 1 << (token_id % 32)


def request_grammar(params, grammars, eos_token_ids=()):
    """What a request's sampler reads in the place of a grammar: its matcher, a thinking gate
    (with the matcher inside for the answer), or None."""
    matcher = grammars.matcher(params.guided) if params.guided is not None else None
    if params.thinking is None or (matcher is None and params.thinking.budget is None):
        return matcher
    return ThinkingGate(params.thinking, matcher, eos_token_ids)
