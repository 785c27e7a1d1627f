"""The one driver behind the generation endpoints: choices built and checked, submitted,
then streamed (SSE) or collected into one JSON body. An endpoint (completions, chat) only
says how its answer looks: its `Endpoint` record."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from pagedllm.core.request import RequestOutput, SamplingParams
from pagedllm.server.choices import (CLIENT_CLOSED, Choice, build_choices, collect, compile_grammar,
                                     public_finish, submit_choices, usage_of)
from pagedllm.server.protocol import now, random_id
from pagedllm.server.sse import StreamSpec, sse_response
from pagedllm.server.state import ServerState


@dataclass(frozen=True)
class Endpoint:
    id_prefix: str      # "cmpl" / "chatcmpl"
    object_name: str    # the whole answer's object
    chunk_object: str   # a streamed chunk's object
    chunk_choice: Callable[[Choice, RequestOutput], dict | None]  # a choice's delta (None: skip)
    final_choice: Callable[[Choice], dict]                 # one choice of the whole answer
    first_delta: dict | None = None  # streamed once per choice before any output (chat: role)


async def answer(state: ServerState, endpoint: Endpoint, body, prompts: list[str | list[int]],
                 params: SamplingParams, http_request: HTTPRequest) -> Response:
    if params.guided is not None:
        # Compile (cached by spec) on a worker thread: neither this event loop nor the engine
        # loop waits for a large schema; the per-request matchers are then cheap.
        await asyncio.to_thread(compile_grammar, state, params.guided)
    choices = build_choices(state, prompts, params, http_request, body.user)
    response_id, model = random_id(endpoint.id_prefix), state.served_model_name
    if body.stream:
        def chunk(choice: Choice, out: RequestOutput) -> dict | None:
            if not out.new_text and not out.finished and not out.new_logprobs:
                return None
            delta = endpoint.chunk_choice(choice, out)
            if delta is None:
                return None
            _tell_finish(state, choice, delta)
            return {"id": response_id, "object": endpoint.chunk_object, "created": now(),
                    "model": model, "choices": [delta]}

        first = () if endpoint.first_delta is None else (
            {"id": response_id, "object": endpoint.chunk_object, "created": now(), "model": model,
             "choices": [{"index": c.index, "delta": endpoint.first_delta, "logprobs": None,
                          "finish_reason": None} for c in choices]},)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        submit_choices(state, choices, body.queue_position)
        return sse_response(state, choices, StreamSpec(response_id, model, endpoint.chunk_object,
                                                       include_usage, first), chunk)
    submit_choices(state, choices)
    if not await collect(state, http_request, choices):
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse({"id": response_id, "object": endpoint.object_name, "created": now(),
                         "model": model, "choices": [_tell_finish(state, c, endpoint.final_choice(c))
                                                     for c in choices],
                         "usage": usage_of(choices)})


def _tell_finish(state: ServerState, choice: Choice, payload: dict) -> dict:
    """A choice's finish_reason as clients know it, with the error when it was cut short."""
    reason, error = public_finish(state, choice, payload.get("finish_reason"))
    payload["finish_reason"] = reason
    if error is not None:
        payload["error"] = error
    return payload
