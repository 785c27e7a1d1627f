"""The model's text -> content and tool calls, fed piece by piece as it streams.

Two ways a family writes calls (tool_calls/syntax.py says which, with its markers and how
its call text reads, tool_calls/bodies.py):
- marked: calls between an opening and a closing marker, any number, with text around
  (Hermes' `<tool_call>...</tool_call>`, DeepSeek's, Phi-4-mini's, Gemma's tool_code
  block); a family whose calls run to the end of the answer has no closing marker
  (Mistral's `[TOOL_CALLS]`);
- leading: the whole answer is calls when it begins as one (Llama 3's `{"name": ...}` or
  `<|python_tag|>`, Llama 3.2/4's `[f(x=1)]`): held back whole and parsed at the end, as
  those families' own server-side parsers do; anything else streams.
What does not parse as a call of an offered function stays content: nothing the model wrote
is lost, except a call the token limit cut off (finish(cut=True)): that is reported as cut
(finish_reason "length"), not shown as raw call syntax.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.tool_calls.spec import Function, ToolCall

if TYPE_CHECKING:
    from pagedllm.tool_calls.syntax import ToolSyntax


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could begin `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class MarkedCallsParser:
    def __init__(self, functions: tuple[Function, ...], syntax: ToolSyntax):
        self._functions = {f.name: f for f in functions}
        self._open, self._close, self._body = syntax.open, syntax.close, syntax.body
        self._buffer = ""
        self._in_call = False
        self._pending_space = ""  # whitespace held until more content follows it
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content to show now and the calls completed by this piece."""
        self._buffer += text
        content, calls = [], []
        while True:
            if not self._in_call:
                start = self._buffer.find(self._open)
                if start < 0:
                    keep = _partial_suffix(self._buffer, self._open)
                    content.append(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(self._open):]
                self._in_call = True
            end = self._buffer.find(self._close) if self._close else -1
            if end < 0:
                break
            body, self._buffer = self._buffer[:end], self._buffer[end + len(self._close):]
            self._in_call = False
            found = self._body(body, self._functions)
            if found is None:
                content.append(self._open + body + self._close)
            else:
                calls += found
        self.calls += calls
        return self._shown("".join(content)), calls

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """What is left at the end: an unclosed call that parses still counts (a model often
        stops before the closing tag); one that does not, when the answer was cut (`cut`:
        finish_reason "length"), was a call cut short and is dropped."""
        calls, dropped = [], False
        if self._in_call:
            found = self._body(self._buffer, self._functions)
            if found is None:
                dropped = cut
                rest = "" if cut else self._open + self._buffer
            else:
                calls, rest = found, ""
        else:
            rest = self._buffer
        self._buffer, self._in_call = "", False
        self.calls += calls
        tail = self._pending_space + rest
        self._pending_space = ""
        return ("" if (self.calls or dropped) and not tail.strip() else tail), calls

    def _shown(self, content: str) -> str:
        text = self._pending_space + content
        stripped = text.rstrip()
        self._pending_space = text[len(stripped):]
        if self.calls and not stripped.strip():
            return ""  # only the whitespace between calls
        return stripped


class LeadingCallsParser:
    def __init__(self, functions: tuple[Function, ...], syntax: ToolSyntax):
        self._functions = {f.name: f for f in functions}
        self._leads, self._body = syntax.leads, syntax.body
        self._held = ""
        self._mode = None  # None: undecided, "calls", "text"
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._mode == "text":
            return text, []
        self._held += text
        start = self._held.lstrip()
        if not start or any(lead.startswith(start) for lead in self._leads):
            return "", []
        if any(start.startswith(lead) for lead in self._leads):
            self._mode = "calls"
            return "", []
        self._mode = "text"
        held, self._held = self._held, ""
        return held, []

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if self._mode == "text" or not held.strip():
            return held, []
        calls = self._body(held, self._functions)
        if calls is None:
            return ("" if cut else held), []  # cut: calls the token limit ended
        self.calls += calls
        return "", calls
