"""Anthropic's Messages API: POST /v1/messages (streamed as Anthropic's event sequence, or one
message) and /v1/messages/count_tokens. The body becomes a conversation (anthropic_protocol.py)
that goes through the same chat preparation (chat_prompt.py) and the one pipeline as every
other API; this module only says how the answer looks. Errors under /v1/messages come in
Anthropic's shape (errors.py)."""
from __future__ import annotations

import json

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pagedllm.server.answer_parts import AnswerParts, whole_answer
from pagedllm.server.anthropic_protocol import CountTokensRequest, MessagesRequest, tool_input
from pagedllm.server.chat_prompt import ChatPrompt, prepare_chat, render_chat, tool_use
from pagedllm.server.choice import Choice, public_finish
from pagedllm.server.drive import outputs
from pagedllm.server.errors import anthropic_error_type
from pagedllm.server.pipeline import Job, run
from pagedllm.server.protocol import random_id
from pagedllm.server.sse import event_stream, named_sse_event
from pagedllm.server.state import ServerState


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: HTTPRequest):
        async with state.serving(body.model) as served:
            prompt, params = await prepare_chat(
                served, body.conversation(), body.sampling_params(), tools=body.openai_tools(),
                tool_choice=body.openai_tool_choice(), continue_final=body.prefill(),
                parallel_tool_calls=body.parallel_tool_calls(),
                template_options=_thinking_options(served, body.thinking),
                thinking_budget=body.thinking.budget() if body.thinking else None)
            job = Job([prompt.token_ids], params, body.stream, body.user(),
                      api="anthropic.messages")
            return await run(served, request, job, MessageShape(body.model, prompt))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        async with state.serving(body.model) as served:
            use = tool_use(served, body.openai_tools(), body.openai_tool_choice())
            prompt = render_chat(served, body.conversation(), use, continue_final=body.prefill(),
                                 template_options=_thinking_options(served, body.thinking))
            return {"input_tokens": len(prompt.token_ids)}


def _thinking_options(served: ServerState, thinking) -> dict:
    if thinking is None:
        return {}
    return thinking.template_options(served.client.tokenizer.has_thinking_switch)


class MessageShape:
    """One message (Anthropic's answer has no n): content blocks of text and tool_use."""

    def __init__(self, model: str, prompt: ChatPrompt):
        self.model = model  # Anthropic's answer names the model as asked
        self.prompt = prompt
        self.message_id = random_id("msg", "_")

    def whole(self, state: ServerState, choices: list[Choice]) -> Response:
        choice = choices[0]
        final = choice.final
        cut = final.finish_reason == "length"
        answer = whole_answer(final.text, cut, self.prompt.tools, self.prompt.thinking)
        text, calls = answer.text, answer.calls
        thinking = ([{"type": "thinking", "thinking": answer.thinking, "signature": SIGNATURE}]
                    if answer.thinking else [])
        content = thinking + ([{"type": "text", "text": text}] if text else []) + [
            {"type": "tool_use", "id": tool_use_id(call), "name": call.name,
             "input": tool_input(call.arguments)} for call in calls]
        reason, error = _stop_reason(state, choice, final.finish_reason, final.stop_string, calls)
        body = {**self._head(choice), "content": content, "stop_reason": reason,
                "stop_sequence": final.stop_string if reason == "stop_sequence" else None,
                "usage": _usage(choice, len(final.token_ids))}
        if error is not None:
            body["error"] = error
        return JSONResponse(body)

    def stream(self, state: ServerState, choices: list[Choice]) -> Response:
        choice = choices[0]

        async def events():
            blocks = _Blocks(self.prompt)
            start = {**self._head(choice), "content": [], "stop_reason": None,
                     "stop_sequence": None, "usage": _usage(choice, 0)}
            yield _event("message_start", {"type": "message_start", "message": start})
            yield _event("ping", {"type": "ping"})
            try:
                async for _, out in outputs(state, choices):
                    for event in blocks.feed(out.new_text, out.finished,
                                             out.finish_reason == "length"):
                        yield _event(event["type"], event)
                    if out.finished:
                        reason, error = _stop_reason(state, choice, out.finish_reason,
                                                     out.stop_string, blocks.calls)
                        if error is not None:
                            yield _event("error", {"type": "error", "error": {
                                "type": "api_error", "message": error["message"]}})
                        yield _event("message_delta", {
                            "type": "message_delta",
                            "delta": {"stop_reason": reason, "stop_sequence":
                                      out.stop_string if reason == "stop_sequence" else None},
                            "usage": {"output_tokens": len(out.token_ids)}})
                        yield _event("message_stop", {"type": "message_stop"})
            except Exception as exc:  # noqa: BLE001 - the status line is sent; say it in-band
                yield _event("error", {"type": "error", "error": {
                    "type": anthropic_error_type(getattr(exc, "status", 500)),
                    "message": str(exc)}})

        return event_stream(events())

    def _head(self, choice: Choice) -> dict:
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "model": self.model}


class _Blocks:
    """A streamed answer as content blocks: a reasoning model's thinking first (thinking
    deltas, then its signature delta, as the SDK expects), text while it is text, each tool
    call as one tool_use block (start, its whole input as one input_json_delta, stop), as
    the SDK reassembles them."""

    def __init__(self, prompt: ChatPrompt):
        self.parts = AnswerParts(prompt.tools, prompt.thinking)
        self.index = 0
        self.text_open = False
        self.thinking_open = False

    @property
    def calls(self) -> list:
        return self.parts.calls

    def feed(self, new_text: str, finished: bool, cut: bool = False) -> list[dict]:
        piece = self.parts.feed(new_text, finished, cut)
        text, calls = piece.text, piece.calls
        events = []
        if piece.thinking:
            if not self.thinking_open:
                events.append({"type": "content_block_start", "index": self.index,
                               "content_block": {"type": "thinking", "thinking": "",
                                                 "signature": ""}})
                self.thinking_open = True
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "thinking_delta", "thinking": piece.thinking}})
        if text or calls or finished:
            events += self._close_thinking()
        if text:
            if not self.text_open:
                events.append({"type": "content_block_start", "index": self.index,
                               "content_block": {"type": "text", "text": ""}})
                self.text_open = True
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "text_delta", "text": text}})
        for call in calls:
            events += self._close_text()
            events += [
                {"type": "content_block_start", "index": self.index,
                 "content_block": {"type": "tool_use", "id": tool_use_id(call), "name": call.name,
                                   "input": {}}},
                {"type": "content_block_delta", "index": self.index,
                 "delta": {"type": "input_json_delta",
                           "partial_json": json.dumps(tool_input(call.arguments))}},
                {"type": "content_block_stop", "index": self.index}]
            self.index += 1
        if finished:
            events += self._close_text()
        return events

    def _close_thinking(self) -> list[dict]:
        if not self.thinking_open:
            return []
        self.thinking_open = False
        self.index += 1
        return [{"type": "content_block_delta", "index": self.index - 1,
                 "delta": {"type": "signature_delta", "signature": SIGNATURE}},
                {"type": "content_block_stop", "index": self.index - 1}]

    def _close_text(self) -> list[dict]:
        if not self.text_open:
            return []
        self.text_open = False
        self.index += 1
        return [{"type": "content_block_stop", "index": self.index - 1}]


def _stop_reason(state: ServerState, choice: Choice, finish_reason: str | None,
                 stop_string: str | None, calls: list) -> tuple[str, dict | None]:
    """Anthropic's stop_reason for an engine finish, and the error when the server cut it."""
    reason, error = public_finish(state, choice, finish_reason)
    if reason == "length":
        return "max_tokens", error
    if calls:
        return "tool_use", None
    return ("stop_sequence" if stop_string else "end_turn"), None


def _usage(choice: Choice, output_tokens: int) -> dict:
    final = choice.final
    cached = final.num_cached_tokens if final is not None else 0
    return {"input_tokens": choice.request.num_prompt_tokens - cached,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "output_tokens": output_tokens}


_event = named_sse_event
# Anthropic signs thinking so that it can be handed back unchanged; nothing here checks one
# handed back, so the field is present (the SDK reads it) and says where the thinking came from.
SIGNATURE = "pagedllm-unsigned"


def tool_use_id(call) -> str:
    """A tool call's id as Anthropic spells them (toolu_...)."""
    return "toolu_" + call.id.removeprefix("call_")
