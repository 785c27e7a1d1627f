"""A chat answer split into what clients see as it comes: a reasoning model's thinking (kept
apart by the family's markers, reasoning/splitter.py), text, and tool calls (each whole, once
its syntax closes; read from the text after the thinking only). Text that may begin a call
or a marker is held back until it is clear. Every chat API reads an answer through this,
streamed piece by piece or whole at once."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.reasoning.splitter import PromptThinking
from pagedllm.server.chat_prompt import ToolUse
from pagedllm.tool_calls.spec import ToolCall


@dataclass
class AnswerPiece:
    thinking: str = ""
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class AnswerParts:
    def __init__(self, tools: ToolUse | None, thinking: PromptThinking | None = None):
        self.parser = tools.new_parser() if tools else None
        self.splitter = thinking.new_splitter() if thinking else None
        self.calls: list[ToolCall] = []  # every call so far
        self.thinking = ""  # all the thinking so far

    def feed(self, new_text: str, finished: bool, cut: bool = False) -> AnswerPiece:
        """What can be shown now of this piece; cut: the answer ended at its token limit (a
        call it cut off is not shown as text)."""
        thinking = ""
        if self.splitter is not None:
            thinking, new_text = self.splitter.feed(new_text)
            if finished:
                more_thinking, more_text = self.splitter.finish()
                thinking, new_text = thinking + more_thinking, new_text + more_text
            self.thinking += thinking
        if self.parser is None:
            return AnswerPiece(thinking, new_text)
        before = len(self.parser.calls)
        text, _ = self.parser.feed(new_text)
        if finished:
            rest, _ = self.parser.finish(cut)
            text += rest
        calls = self.parser.calls[before:]
        self.calls += calls
        return AnswerPiece(thinking, text, calls)


def whole_answer(text: str, cut: bool, tools: ToolUse | None,
                 thinking: PromptThinking | None) -> AnswerPiece:
    """A finished answer's thinking, text and calls at once."""
    return AnswerParts(tools, thinking).feed(text, True, cut)

