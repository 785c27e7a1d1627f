"""The model's text -> content and tool calls, fed piece by piece as it streams.

Two syntaxes, the ones the open models are trained on:
- Hermes (Qwen 2.5/3, Hermes, and pagedllm's prompt for templates that know no tools):
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, any number, with text around;
- Llama 3 JSON: the whole answer is `{"name": ..., "parameters": {...}}` (several joined by
  `;`), optionally after `<|python_tag|>`.
What does not parse as a call of an offered function stays content: nothing the model wrote
is lost, except a call the token limit cut off (finish(cut=True)): that is reported as cut
(finish_reason "length"), not shown as raw call syntax.
"""
from __future__ import annotations

import json

from pagedllm.tool_calls.spec import Function, ToolCall


def _call_from(obj, functions: dict[str, Function], arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in functions:
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall.new(obj["name"], arguments)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could begin `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, functions: tuple[Function, ...]):
        self._functions = {f.name: f for f in functions}
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
                start = self._buffer.find(self.OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buffer, self.OPEN)
                    content.append(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(self.OPEN):]
                self._in_call = True
            end = self._buffer.find(self.CLOSE)
            if end < 0:
                break
            body, self._buffer = self._buffer[:end], self._buffer[end + len(self.CLOSE):]
            self._in_call = False
            call = self._parse(body)
            if call is None:
                content.append(self.OPEN + body + self.CLOSE)
            else:
                calls.append(call)
        self.calls += calls
        return self._shown("".join(content)), calls

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """What is left at the end: an unclosed call that parses still counts (a model often
        stops before the closing tag); one that does not, when the answer was cut (`cut`:
        finish_reason "length"), was a call cut short and is dropped."""
        calls = []
        if self._in_call:
            call = self._parse(self._buffer)
            if call is None:
                rest = "" if cut else self.OPEN + self._buffer
            else:
                calls, rest = [call], ""
        else:
            rest = self._buffer
        self._buffer, self._in_call = "", False
        self.calls += calls
        tail = self._pending_space + rest
        self._pending_space = ""
        return ("" if self.calls and not tail.strip() else tail), calls

    def _shown(self, content: str) -> str:
        text = self._pending_space + content
        stripped = text.rstrip()
        self._pending_space = text[len(stripped):]
        if self.calls and not stripped.strip():
            return ""  # only the whitespace between calls
        return stripped

    def _parse(self, body: str) -> ToolCall | None:
        try:
            return _call_from(json.loads(body.strip()), self._functions, "arguments")
        except json.JSONDecodeError:
            return None


class Llama3JsonParser:
    """The answer is calls when it begins with `{` (or the python tag): held back whole and
    parsed at the end, as Llama 3's own server-side parsers do; anything else streams."""

    TAG = "<|python_tag|>"

    def __init__(self, functions: tuple[Function, ...]):
        self._functions = {f.name: f for f in functions}
        self._held = ""
        self._mode = None  # None: undecided, "calls", "text"
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._mode == "text":
            return text, []
        self._held += text
        start = self._held.lstrip()
        if not start or self.TAG.startswith(start):
            return "", []
        if start.startswith("{") or start.startswith(self.TAG):
            self._mode = "calls"
            return "", []
        self._mode = "text"
        held, self._held = self._held, ""
        return held, []

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if self._mode == "text" or not held.strip():
            return held, []
        calls = self._parse(held.strip().removeprefix(self.TAG))
        if calls is None:
            return ("" if cut else held), []  # cut: calls the token limit ended
        self.calls += calls
        return "", calls

    def _parse(self, text: str) -> list[ToolCall] | None:
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            while at < len(text) and text[at] in " \t\r\n;":
                at += 1
            if at == len(text):
                return calls or None
            try:
                obj, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return None
            call = _call_from(obj, self._functions, "parameters")
            if call is None:
                return None
            calls.append(call)
