"""A streamed chat answer split into what clients see as it comes: text, and tool calls
(each whole, once its syntax closes). Text that may begin a call is held back by the model's
tool-call parser (tool_calls/parser.py). Every API that streams content blocks or output
items (Anthropic's, the Responses API) reads an answer through this."""
from __future__ import annotations

from pagedllm.server.chat_prompt import ToolUse
from pagedllm.tool_calls.spec import ToolCall


class AnswerParts:
    def __init__(self, tools: ToolUse | None):
        self.parser = tools.new_parser() if tools else None
        self.calls: list[ToolCall] = []  # every call so far

    def feed(self, new_text: str, finished: bool,
             cut: bool = False) -> tuple[str, list[ToolCall]]:
        """The text that can be shown now and the calls completed by this piece; cut: the
        answer ended at its token limit (a call it cut off is not shown as text)."""
        if self.parser is None:
            return new_text, []
        before = len(self.parser.calls)
        text, _ = self.parser.feed(new_text)
        if finished:
            rest, _ = self.parser.finish(cut)
            text += rest
        calls = self.parser.calls[before:]
        self.calls += calls
        return text, calls
