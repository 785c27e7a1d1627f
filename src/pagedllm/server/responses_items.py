"""The Responses API's output items (reasoning, message, function_call) whole, and a streamed
answer as those items and their events."""
from __future__ import annotations

from pagedllm.server.answer_parts import AnswerParts
from pagedllm.server.chat_prompt import ChatPrompt
from pagedllm.server.protocol import random_id
from pagedllm.server.sse import named_sse_event
from pagedllm.tool_calls.spec import ToolCall


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)] if status == "completed" else []}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def reasoning_tokens(thinking, token_ids: list[int]) -> int:
    return thinking.reasoning_tokens(token_ids) if thinking is not None else 0


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """A reasoning model's thinking, whole (no summary is written)."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [_reasoning_part(text)] if status == "completed" else []}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def call_item(call: ToolCall, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments if status == "completed" else "",
            "status": status}


class OutputItems:
    """A streamed answer as the Responses API's output items and their events: a reasoning
    item while a reasoning model thinks, a message item while the answer is text, one
    function_call item per tool call."""

    def __init__(self, prompt: ChatPrompt):
        self.parts = AnswerParts(prompt.tools, prompt.thinking)
        self.output: list[dict] = []  # finished items
        self.text = ""  # all text shown
        self.sequence = 0
        self.message_id: str | None = None  # the open message item
        self.message_text = ""
        self.reasoning_id: str | None = None  # the open reasoning item
        self.reasoning_text = ""

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return named_sse_event(kind, payload)

    def feed(self, new_text: str, finished: bool, cut: bool = False) -> list[str]:
        piece = self.parts.feed(new_text, finished, cut)
        text, calls = piece.text, piece.calls
        events = self._think(piece.thinking)
        if text or calls or finished:
            events += self._close_reasoning()
        if text:
            if self.message_id is None:
                self.message_id = random_id("msg", "_")
                self.message_text = ""
                where = self._where()
                events.append(self.event("response.output_item.added",
                                         output_index=where["output_index"],
                                         item=message_item(self.message_id, "", "in_progress")))
                events.append(self.event("response.content_part.added", **where,
                                         part=_text_part("")))
            self.message_text += text
            self.text += text
            events.append(self.event("response.output_text.delta", **self._where(), delta=text,
                                     logprobs=[]))
        for call in calls:
            events += self._close_message()
            index = len(self.output)
            item_id = f"fc_{call.id}"
            events += [
                self.event("response.output_item.added", output_index=index,
                           item=call_item(call, "in_progress")),
                self.event("response.function_call_arguments.delta", item_id=item_id,
                           output_index=index, delta=call.arguments),
                self.event("response.function_call_arguments.done", item_id=item_id,
                           output_index=index, arguments=call.arguments)]
            self.output.append(call_item(call, "completed"))
            events.append(self.event("response.output_item.done", output_index=index,
                                     item=self.output[-1]))
        if finished:
            events += self._close_message()
        return events

    def _think(self, thinking: str) -> list[str]:
        if not thinking:
            return []
        events = []
        if self.reasoning_id is None:
            self.reasoning_id, self.reasoning_text = random_id("rs", "_"), ""
            events.append(self.event("response.output_item.added", output_index=len(self.output),
                                     item=reasoning_item(self.reasoning_id, "", "in_progress")))
        self.reasoning_text += thinking
        events.append(self.event("response.reasoning_text.delta", item_id=self.reasoning_id,
                                 output_index=len(self.output), content_index=0,
                                 delta=thinking))
        return events

    def _close_reasoning(self) -> list[str]:
        if self.reasoning_id is None:
            return []
        index, text = len(self.output), self.reasoning_text
        item = reasoning_item(self.reasoning_id, text, "completed")
        events = [self.event("response.reasoning_text.done", item_id=self.reasoning_id,
                             output_index=index, content_index=0, text=text),
                  self.event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        self.reasoning_id = None
        return events

    def _where(self) -> dict:
        return {"item_id": self.message_id, "output_index": len(self.output),
                "content_index": 0}

    def _close_message(self) -> list[str]:
        if self.message_id is None:
            return []
        where, text = self._where(), self.message_text
        item = message_item(self.message_id, text, "completed")
        events = [self.event("response.output_text.done", **where, text=text, logprobs=[]),
                  self.event("response.content_part.done", **where, part=_text_part(text)),
                  self.event("response.output_item.done", output_index=where["output_index"],
                             item=item)]
        self.output.append(item)
        self.message_id = None
        return events
