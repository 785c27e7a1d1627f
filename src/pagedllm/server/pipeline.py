"""The one request pipeline every generation API goes through:

  parse (the API's module: its body -> a Job)
  -> grammar compiled off the event loop (cached by content)
  -> who asks, admission (queue room, the key's rate), limits resolved once per choice
     (OutputCaps -> core.output_budget.resolve_max_tokens, inside make_request)
  -> one engine request per prompt x n, submitted with no await in between
  -> driven (drive.py) -> shaped by the API's Shape (SSE, NDJSON or one JSON body).

Bad input anywhere raises a FieldError (errors.py) or an APIError; app.py's handlers turn
them into the called API's error shape. No API module re-implements a step."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Protocol

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from pagedllm.core.request import SamplingParams
from pagedllm.errors import EngineUnavailableError
from pagedllm.server.auth import ApiKey
from pagedllm.server.choice import Choice
from pagedllm.server.drive import CLIENT_CLOSED, collect
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import random_id
from pagedllm.server.state import ServerState


@dataclass(frozen=True)
class Job:
    """What an API's parse step makes of a request body: the engine's terms alone."""

    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool = False
    user_field: str | None = None  # the body's `user` (without keys: who asks)
    context: int | None = None  # the client's own context window (Ollama's num_ctx)
    report_position: bool = False  # stream queue positions while waiting
    api: str = "openai.completions"  # the API it came through: the metrics' `api` label


class Shape(Protocol):
    """How one API's answer looks, streamed or whole, over driven choices."""

    def stream(self, state: ServerState, choices: list[Choice]) -> Response: ...

    def whole(self, state: ServerState, choices: list[Choice]) -> Response: ...


async def run(state: ServerState, http_request: HTTPRequest, job: Job, shape: Shape) -> Response:
    if job.params.guided is not None:
        # Compiled (cached by spec) on a worker thread: neither this event loop nor the
        # engine loop waits for a large schema; the per-request matchers are then cheap.
        await asyncio.to_thread(state.client.compile_grammar, job.params.guided)
    choices = make_choices(state, http_request, job)
    submit(state, choices, job.report_position and job.stream)
    state.metrics.api_requests.labels(state.served_model_name, job.api).inc()
    if job.stream:
        return shape.stream(state, choices)
    if not await collect(state, http_request, choices):
        return Response(status_code=CLIENT_CLOSED)
    return shape.whole(state, choices)


def make_choices(state: ServerState, http_request: HTTPRequest, job: Job) -> list[Choice]:
    """Check admission and make one engine request per prompt x n (nothing is queued yet)."""
    cap = state.config.max_prompts_per_request
    if len(job.prompts) > cap:
        raise APIError(400, f"the request lists {len(job.prompts)} prompts; this server takes "
                            f"at most {cap} (--max-prompts-per-request)", "prompt",
                       "too_many_prompts")
    user, key = state.admit(http_request, job.user_field, len(job.prompts) * job.params.n)
    choices: list[Choice] = []
    try:
        arrival = time.monotonic()
        for p_index, prompt in enumerate(job.prompts):
            for j in range(job.params.n):
                choices.append(_make_choice(state, job, prompt, j, user, key, arrival,
                                            len(choices), p_index))
    except BaseException:
        for choice in choices:  # nothing was queued: give back what they reserved
            choice.settle_tokens(state, queued=False)
        raise
    return choices


def _make_choice(state: ServerState, job: Job, prompt, j: int, user: str, key: ApiKey | None,
                 arrival: float, index: int, p_index: int) -> Choice:
    params = job.params
    child = params if params.n == 1 else replace(
        params, n=1, seed=None if params.seed is None else params.seed + j)
    if state.lora is not None:  # the view's adapter (its `model`, or llama.cpp's `lora`)
        child = replace(child, lora=state.lora, lora_scale=state.lora_scale)
    # The caps are read per choice: the key's budget shrinks with each reservation.
    request = state.client.make_request(random_id("req"), prompt, child, user=user,
                                        cache_salt=state.cache_salt_for(user),
                                        caps=state.output_caps(key, job.context))
    limit = state.config.max_prompt_tokens
    if limit and request.num_prompt_tokens > limit:
        raise APIError(400, f"the prompt has {request.num_prompt_tokens} tokens, over this "
                            f"server's limit of {limit}", "prompt", "prompt_too_long")
    choice = Choice(index, p_index, request, arrival, user=user, key=key)
    if key is not None:
        choice.reservation = state.rate_limiter.reserve(
            key.name, key.tokens_per_minute, request.num_prompt_tokens, request.max_tokens)
    return choice


def submit(state: ServerState, choices: list[Choice], report_position: bool = False) -> None:
    """Queue every choice's request, with no await between the queue check and this."""
    for index, choice in enumerate(choices):
        try:
            choice.stream = state.client.submit(choice.request, report_position)
        except EngineUnavailableError as exc:  # the instant after an engine process died
            for submitted in choices[:index]:
                state.client.abort(submitted.request.request_id)
                state.live_choices.pop(submitted.request.request_id, None)
            for unsent in choices:  # nothing ran: the key's reservation is given back
                unsent.settle_tokens(state, queued=False)
            raise APIError(503, f"the engine is restarting: {exc}; retry shortly", None,
                           "engine_restarting", {"Retry-After": "2"}) from exc
        state.live_choices[choice.request.request_id] = choice
