"""OpenAI's Responses API: POST /v1/responses (streamed as its typed events, or one response
object), GET and DELETE /v1/responses/{id}. The body becomes a conversation
(responses_protocol.py), continued from a stored response when `previous_response_id` names
one (response_store.py: bounded, each entry visible to its owner alone), and goes through
the same chat preparation (chat_prompt.py) and the one pipeline as every other API; this
module says how the answer looks and keeps it."""
from __future__ import annotations

import time

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pagedllm.server.answer_parts import whole_answer
from pagedllm.server.chat_prompt import ChatPrompt, prepare_chat
from pagedllm.server.choice import Choice, public_finish
from pagedllm.server.drive import outputs
from pagedllm.server.errors import APIError
from pagedllm.server.pipeline import Job, run
from pagedllm.server.protocol import random_id
from pagedllm.server.responses_items import (OutputItems, call_item, message_item, reasoning_item,
                                             reasoning_tokens)
from pagedllm.server.responses_protocol import ResponsesRequest
from pagedllm.server.sse import event_stream
from pagedllm.server.state import ServerState
from pagedllm.tool_calls.spec import ToolCall


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/responses")
    @app.post("/responses", include_in_schema=False)
    async def create(body: ResponsesRequest, request: HTTPRequest):
        async with state.serving(body.model) as served:
            if body.reasoning is not None and body.reasoning.effort is not None and \
                    served.reasoning_syntax() is None:
                raise APIError(400, "this model does not think before it answers (no reasoning "
                                    "parser applies to it: --reasoning-parser), so there is no "
                                    "reasoning effort to set", "reasoning.effort",
                               "unsupported_value")
            owner = _owner(served, request)
            conversation = _earlier(served, body, owner) + body.conversation()
            prompt, params = await prepare_chat(
                served, conversation, body.sampling_params(), tools=body.chat_tools(),
                tool_choice=body.chat_tool_choice(),
                parallel_tool_calls=body.parallel_tool_calls,
                template_options=body.template_options(
                    served.client.tokenizer.has_thinking_switch))
            job = Job([prompt.token_ids], params, body.stream, body.user, api="openai.responses")
            shape = ResponseShape(body, prompt, conversation, owner,
                                  body.model or served.served_model_name)
            return await run(served, request, job, shape)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: HTTPRequest):
        entry = state.responses.get(response_id, _owner(state, request))
        if entry is None:
            raise _not_found(response_id)
        return entry.body

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: HTTPRequest):
        if not state.responses.delete(response_id, _owner(state, request)):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _owner(state: ServerState, request: HTTPRequest) -> str:
    """Whose stored responses a request may read: its API key's, else its address's (not
    the body's `user`, which anyone can write)."""
    return state.identify(request, None)[0]


def _earlier(state: ServerState, body: ResponsesRequest, owner: str) -> list[dict]:
    if body.previous_response_id is None:
        return []
    entry = state.responses.get(body.previous_response_id, owner)
    if entry is None:
        raise APIError(404, f"no stored response {body.previous_response_id!r}: responses are "
                            f"kept for an hour, within a bounded store, and only for whoever "
                            f"made them", "previous_response_id", "not_found")
    earlier = list(entry.conversation)
    if body.instructions:  # the new instructions replace the earlier ones, as OpenAI does
        earlier = [turn for turn in earlier if turn["role"] != "system"]
    return earlier


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response {response_id!r}", "response_id", "not_found")


class ResponseShape:
    def __init__(self, body: ResponsesRequest, prompt: ChatPrompt,
                 conversation: list[dict], owner: str, model: str):
        self.body = body
        self.model = model
        self.prompt = prompt
        self.conversation = conversation
        self.owner = owner
        self.response_id = random_id("resp", "_")
        self.created_at = int(time.time())

    def whole(self, state: ServerState, choices: list[Choice]) -> Response:
        choice = choices[0]
        final = choice.final
        cut = final.finish_reason == "length"
        answer = whole_answer(final.text, cut, self.prompt.tools, self.prompt.thinking)
        text, calls = answer.text, answer.calls
        output = (([reasoning_item(random_id("rs", "_"), answer.thinking, "completed")]
                   if answer.thinking else [])
                  + ([message_item(random_id("msg", "_"), text, "completed")] if text else [])
                  + [call_item(call, "completed") for call in calls])
        return JSONResponse(self._finish(state, choice, output, text, calls))

    def stream(self, state: ServerState, choices: list[Choice]) -> Response:
        choice = choices[0]

        async def events():
            items = OutputItems(self.prompt)
            yield items.event("response.created", response=self._body("in_progress", []))
            yield items.event("response.in_progress", response=self._body("in_progress", []))
            try:
                async for _, out in outputs(state, choices):
                    for event in items.feed(out.new_text, out.finished,
                                            out.finish_reason == "length"):
                        yield event
                    if out.finished:
                        body = self._finish(state, choice, items.output, items.text,
                                            items.parts.calls)
                        kind = {"completed": "response.completed",
                                "incomplete": "response.incomplete"}[body["status"]]
                        yield items.event(kind, response=body)
            except Exception as exc:  # noqa: BLE001 - the status line is sent; say it in-band
                yield items.event("error", code=getattr(exc, "code", None), message=str(exc),
                                  param=getattr(exc, "param", None))

        return event_stream(events())

    def _finish(self, state: ServerState, choice: Choice, output: list[dict], text: str,
                calls: list[ToolCall]) -> dict:
        """The final response object; kept in the store when the request asked (store)."""
        final = choice.final
        reason, error = public_finish(state, choice, final.finish_reason)
        body = self._body("incomplete" if reason == "length" else "completed", output)
        if reason == "length":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if error is not None:
            body["error"] = {"code": "server_error", "message": error["message"]}
        cached = final.num_cached_tokens
        prompt_tokens, output_tokens = len(final.prompt_token_ids), len(final.token_ids)
        body["usage"] = {"input_tokens": prompt_tokens,
                         "input_tokens_details": {"cached_tokens": cached},
                         "output_tokens": output_tokens,
                         "output_tokens_details": {"reasoning_tokens": reasoning_tokens(
                             choice.request.params.thinking, final.token_ids)},
                         "total_tokens": prompt_tokens + output_tokens}
        if self.body.store:
            answer = {"role": "assistant", "content": text}
            if calls:
                answer["tool_calls"] = [{"id": c.id, "name": c.name,
                                         "arguments": c.arguments_dict} for c in calls]
            state.responses.put(self.response_id, self.owner, self.conversation + [answer],
                                body)
        return body

    def _body(self, status: str, output: list[dict]) -> dict:
        body = self.body
        fmt = body.text.format if body.text and body.text.format else None
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output, "error": None,
            "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tool_choice": _tool_choice(body),
            "tools": [t.model_dump() for t in body.tools or []],
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "metadata": body.metadata or {}, "store": body.store, "truncation": "disabled",
            "usage": None, "user": body.user}


def _tool_choice(body: ResponsesRequest):
    choice = body.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()
