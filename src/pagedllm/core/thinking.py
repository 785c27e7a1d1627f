"""What the engine knows of a request's thinking (a reasoning model's): the token ids of the
family's markers, whether the prompt left the thinking open, and the budget of thinking
tokens after which the end marker is written into the sequence. The server makes it from
the reasoning parser (reasoning/syntax.py); the engine's gate (reasoning/gate.py) acts on it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkingControl:
    start_ids: tuple[int, ...]  # the start marker's tokens
    end_ids: tuple[int, ...]  # the end marker's tokens (what a budget writes)
    inside: bool  # the prompt left the thinking open: the answer starts inside it
    budget: int | None = None  # thinking tokens before the end marker is written

    def __post_init__(self):
        if not self.start_ids or not self.end_ids:
            raise ValueError("a thinking marker has no tokens")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"a thinking budget must be at least 1 token, got {self.budget}")

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """An answer's tokens that were thinking: up to and including the end marker (all
        of them when it never came), when the answer thought at all."""
        start, end = list(self.start_ids), list(self.end_ids)
        if not token_ids or (not self.inside and token_ids[:len(start)] != start):
            return 0
        for i in range(len(token_ids) - len(end) + 1):
            if token_ids[i:i + len(end)] == end:
                return i + len(end)
        return len(token_ids)
