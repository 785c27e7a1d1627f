"""An answer's text split into thinking and what follows, as it streams: a marker split over
several pieces is held back until it is whole (or cannot be), so no piece of a marker ever
reaches either side."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.reasoning.syntax import ReasoningSyntax


def _partial_at_end(text: str, marker: str) -> int:
    """How many characters at the end of text could begin marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ThinkingSplitter:
    """inside: the prompt left the thinking open. Otherwise thinking is only what the answer
    opens with the start marker (after blank space at most); a marker later in the answer is
    answer text."""

    def __init__(self, syntax: ReasoningSyntax, inside: bool):
        self.syntax = syntax
        self.inside = inside
        self.opening = not inside  # the answer may still open with the start marker
        self.ended = False  # the end marker came
        self._held = ""
        self._answer_begun = False  # the newlines after the end marker are not the answer's

    def feed(self, text: str) -> tuple[str, str]:
        """(thinking, answer) shown now of this piece."""
        text = self._held + text
        self._held = ""
        if self.opening:
            stripped = text.lstrip()
            start = self.syntax.start
            if stripped.startswith(start):
                self.opening, self.inside = False, True
                text = stripped[len(start):]
            elif start.startswith(stripped):  # blank space or a part of the marker so far
                self._held = text
                return "", ""
            else:
                self.opening = False
                self._answer_begun = True
        thinking = ""
        if self.inside:
            end = text.find(self.syntax.end)
            if end < 0:
                keep = _partial_at_end(text, self.syntax.end)
                self._held = text[len(text) - keep:] if keep else ""
                return text[:len(text) - keep], ""
            thinking, text = text[:end], text[end + len(self.syntax.end):]
            self.inside, self.ended = False, True
        return thinking, self._answer(text)

    def _answer(self, text: str) -> str:
        if not self._answer_begun:
            text = text.lstrip("\n")
            self._answer_begun = bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        """What was held back at the end: thinking inside, else answer text."""
        held, self._held = self._held, ""
        if self.inside:
            return held, ""
        return "", held if self._answer_begun or self.opening else self._answer(held)


@dataclass(frozen=True)
class PromptThinking:
    """How a rendered prompt leaves a reasoning model's thinking: the family's syntax, and
    whether the answer starts inside the thinking."""

    syntax: ReasoningSyntax
    inside: bool

    def new_splitter(self) -> ThinkingSplitter:
        return ThinkingSplitter(self.syntax, self.inside)
