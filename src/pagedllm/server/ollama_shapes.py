"""How an answer's text goes into Ollama's lines: /api/generate's `response`, or /api/chat's
`message` (with `tool_calls` read from the text when tools were offered: each call in the
line where it completes, arguments as an object, as Ollama sends them)."""
from __future__ import annotations

from pagedllm.core.request import RequestOutput


class GenerateShape:
    def feed(self, text: str) -> dict | None:
        return {"response": text} if text else None

    def finish(self, cut: bool = False) -> dict:
        return {"response": ""}

    def whole(self, text: str, cut: bool = False) -> dict:
        return {"response": text}

    def final_extra(self, out: RequestOutput) -> dict:
        # Ollama's context: the tokens to send back to continue this text.
        return {"context": out.prompt_token_ids + out.token_ids}


class ChatShape:
    def __init__(self, tools=None):
        """tools: a chat_prompt.ToolUse, or None when the request offered none."""
        self._tools = tools
        self._parser = tools.new_parser() if tools is not None else None

    def feed(self, text: str) -> dict | None:
        if self._parser is None:
            return _message(text) if text else None
        content, calls = self._parser.feed(text)
        return _message(content, calls) if content or calls else None

    def finish(self, cut: bool = False) -> dict:
        """cut: the answer ended at its token limit (a call it cut off is not content)."""
        if self._parser is None:
            return _message("")
        return _message(*self._parser.finish(cut))

    def whole(self, text: str, cut: bool = False) -> dict:
        return _message(text) if self._tools is None else _message(*self._tools.parse(text, cut))

    def final_extra(self, out: RequestOutput) -> dict:
        return {}


def _message(content: str, calls=()) -> dict:
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments_dict}}
                                 for c in calls]
    return {"message": message}
