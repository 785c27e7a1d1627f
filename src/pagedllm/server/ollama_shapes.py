"""How an answer's text goes into Ollama's lines: /api/generate's `response`, or /api/chat's
`message` (with `tool_calls` read from the text when tools were offered: each call in the
line where it completes, arguments as an object, as Ollama sends them; a reasoning model's
thinking as `thinking`)."""
from __future__ import annotations

from pagedllm.core.request import RequestOutput
from pagedllm.server.answer_parts import AnswerParts, AnswerPiece, whole_answer


class GenerateShape:
    def __init__(self, thinking=None):
        """thinking: a reasoning model's (reasoning/splitter.py's PromptThinking), or None."""
        self._thinking = thinking
        self._parts = AnswerParts(None, thinking)

    def feed(self, text: str) -> dict | None:
        piece = self._parts.feed(text, False)
        return _response(piece) if piece.text or piece.thinking else None

    def finish(self, cut: bool = False) -> dict:
        return _response(self._parts.feed("", True, cut))

    def whole(self, text: str, cut: bool = False) -> dict:
        return _response(whole_answer(text, cut, None, self._thinking))

    def final_extra(self, out: RequestOutput) -> dict:
        # Ollama's context: the tokens to send back to continue this text.
        return {"context": out.prompt_token_ids + out.token_ids}


class ChatShape:
    def __init__(self, prompt):
        """prompt: the chat_prompt.ChatPrompt answered (its tools, a reasoning model's
        thinking)."""
        self._prompt = prompt
        self._parts = AnswerParts(prompt.tools, prompt.thinking)

    def feed(self, text: str) -> dict | None:
        piece = self._parts.feed(text, False)
        return _message(piece) if piece.text or piece.calls or piece.thinking else None

    def finish(self, cut: bool = False) -> dict:
        """cut: the answer ended at its token limit (a call it cut off is not content)."""
        return _message(self._parts.feed("", True, cut))

    def whole(self, text: str, cut: bool = False) -> dict:
        return _message(whole_answer(text, cut, self._prompt.tools, self._prompt.thinking))

    def final_extra(self, out: RequestOutput) -> dict:
        return {}


def _message(piece: AnswerPiece) -> dict:
    message = {"role": "assistant", "content": piece.text}
    if piece.thinking:
        message["thinking"] = piece.thinking
    if piece.calls:
        message["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments_dict}}
                                 for c in piece.calls]
    return {"message": message}


def _response(piece: AnswerPiece) -> dict:
    return {"response": piece.text, **({"thinking": piece.thinking} if piece.thinking else {})}
