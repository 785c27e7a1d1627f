"""How an OpenAI-style answer looks (completions, chat): an `Endpoint` record says how one
choice reads as a streamed delta and in the whole answer; `OpenAIShape` makes the SSE stream
(ending with `data: [DONE]`) or the one JSON body of it. The pipeline (pipeline.py) does the
rest."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response

from pagedllm.core.request import RequestOutput
from pagedllm.server.choice import Choice, public_finish, usage_of
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


class OpenAIShape:
    def __init__(self, endpoint: Endpoint, include_usage: bool = False):
        self.endpoint = endpoint
        self.include_usage = include_usage
        self.response_id = random_id(endpoint.id_prefix)

    def stream(self, state: ServerState, choices: list[Choice]) -> Response:
        endpoint, response_id, model = self.endpoint, self.response_id, state.served_model_name

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
        return sse_response(state, choices, StreamSpec(response_id, model, endpoint.chunk_object,
                                                       self.include_usage, first), chunk)

    def whole(self, state: ServerState, choices: list[Choice]) -> Response:
        endpoint = self.endpoint
        return JSONResponse({"id": self.response_id, "object": endpoint.object_name,
                             "created": now(), "model": state.served_model_name,
                             "choices": [_tell_finish(state, c, endpoint.final_choice(c))
                                         for c in choices],
                             "usage": usage_of(choices)})


def _tell_finish(state: ServerState, choice: Choice, payload: dict) -> dict:
    """A choice's finish_reason as clients know it, with the error when it was cut short."""
    reason, error = public_finish(state, choice, payload.get("finish_reason"))
    payload["finish_reason"] = reason
    if error is not None:
        payload["error"] = error
    return payload
