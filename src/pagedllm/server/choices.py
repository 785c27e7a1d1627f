"""One engine request per answer choice: limits checked, submitted, driven to the end,
observed in metrics; merged into SSE streams or collected for a JSON answer.

Each prompt x n becomes one engine request (the n samples share the prompt's KV blocks
through the prefix cache). A client that goes away aborts its requests.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import Request as HTTPRequest

from pagedllm.core.async_engine import QueuePosition, RequestStream
from pagedllm.core.request import (FinishReason, PromptTooLongError, Request, RequestOutput,
                                   SamplingParams, SamplingParamsError)
from pagedllm.server.auth import ApiKey
from pagedllm.server.errors import APIError
from pagedllm.server.limits import TokenUse
from pagedllm.server.protocol import random_id, usage
from pagedllm.server.state import ServerState
from pagedllm.structured.spec import GrammarError, GrammarSpec


@dataclass
class Choice:
    """One engine request answering one choice; tracks what the client has seen."""

    index: int
    prompt_index: int
    request: Request
    arrival: float
    stream: RequestStream | None = None  # once submitted
    first_token_time: float | None = None
    user: str = ""
    key: ApiKey | None = None
    final: RequestOutput | None = None
    cut_reason: str | None = None  # why the server aborted it (a timeout), when it did
    tokens_seen: int = 0  # generated tokens so far
    reservation: TokenUse | None = None  # its key's tokens-per-minute share, until settled

    def settle_tokens(self, state: ServerState, queued: bool = True) -> None:
        """Once, when it ends however it ends: its tokens count as used, not reserved (none
        at all when it was never queued)."""
        if self.reservation is not None:
            used = self.request.num_prompt_tokens + self.tokens_seen if queued else 0
            state.rate_limiter.settle(self.reservation, used)
            self.reservation = None


def build_choices(state: ServerState, prompts: list[str | list[int]], params: SamplingParams,
                  http_request: HTTPRequest, user_field: str | None) -> list[Choice]:
    """Check limits and make one engine request per prompt x n (nothing is queued yet)."""
    user, key = state.identity(http_request, user_field)
    state.admit(key, len(prompts) * params.n)
    choices: list[Choice] = []
    try:
        _make_choices(state, choices, prompts, params, user, key)
    except BaseException:
        for choice in choices:  # nothing was queued: give back what they reserved
            choice.settle_tokens(state, queued=False)
        raise
    return choices


def _make_choices(state: ServerState, choices: list[Choice], prompts: list[str | list[int]],
                  params: SamplingParams, user: str, key: ApiKey | None) -> None:
    engine, options = state.engine, state.config
    arrival = time.monotonic()
    for p_index, prompt in enumerate(prompts):
        for j in range(params.n):
            child = params if params.n == 1 else _child_params(params, j)
            try:
                req = engine.make_request(random_id("req"), prompt, child, user=user,
                                          cache_salt=state.cache_salt_for(user),
                                          max_tokens_limit=options.max_tokens_limit)
            except PromptTooLongError as exc:
                raise APIError(400, str(exc), "max_tokens", "context_length_exceeded") from exc
            except SamplingParamsError as exc:
                raise APIError(400, str(exc), exc.param, "invalid_value") from exc
            except GrammarError as exc:
                raise APIError(400, str(exc), exc.param, "invalid_grammar") from exc
            except ValueError as exc:
                raise APIError(400, str(exc), "prompt", "invalid_value") from exc
            limit = options.max_prompt_tokens
            if limit and req.num_prompt_tokens > limit:
                raise APIError(400, f"the prompt has {req.num_prompt_tokens} tokens, over this "
                                    f"server's limit of {limit}", "prompt", "prompt_too_long")
            choice = Choice(len(choices), p_index, req, arrival, user=user, key=key)
            if key is not None:
                choice.reservation, req.max_tokens = state.rate_limiter.reserve(
                    key.name, key.tokens_per_minute, req.num_prompt_tokens, req.max_tokens,
                    fixed=child.max_tokens is not None)
            choices.append(choice)


def compile_grammar(state: ServerState, spec: GrammarSpec) -> None:
    """Compile a request's grammar into the engine's cache (a worker thread calls this)."""
    try:
        state.engine.grammars.compile(spec)
    except GrammarError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_grammar") from exc


def submit_choices(state: ServerState, choices: list[Choice], report_position: bool = False) -> None:
    """Queue every choice's request, with no await between the queue check and this."""
    for choice in choices:
        choice.stream = state.async_engine.submit(choice.request, report_position)
        state.live_choices[choice.request.request_id] = choice


def _child_params(params: SamplingParams, j: int) -> SamplingParams:
    return replace(params, n=1, seed=None if params.seed is None else params.seed + j)


async def _drive(state: ServerState, choice: Choice, sink: asyncio.Queue | None) -> None:
    timeout = state.config.request_timeout
    timer = None
    if timeout:
        def cut_short():
            choice.cut_reason = f"it ran past this server's request timeout of {timeout:g} s"
            state.async_engine.abort(choice.request.request_id)
        timer = asyncio.get_running_loop().call_later(timeout, cut_short)
    try:
        async for out in choice.stream:
            if isinstance(out, QueuePosition):
                if sink is not None:
                    await sink.put((choice, out))
                continue
            await _on_output(state, choice, out, sink)
    except Exception as exc:  # noqa: BLE001 - a stream must end with its error, never hang
        if sink is None:
            raise
        await sink.put((choice, exc))
    finally:
        if timer is not None:
            timer.cancel()
        choice.settle_tokens(state)
        state.live_choices.pop(choice.request.request_id, None)


async def _on_output(state: ServerState, choice: Choice, out: RequestOutput, sink) -> None:
    if choice.first_token_time is None and out.new_token_ids:
        choice.first_token_time = time.monotonic()
    choice.tokens_seen = len(out.token_ids)
    if out.finished:
        _observe_finish(state, choice, out)
    if out.error is not None:  # counted above like any finish; the client gets the error
        raise APIError(500, f"this request failed in the engine ({out.error}); the server "
                            f"goes on serving", None, "request_failed")
    if sink is not None:
        await sink.put((choice, out))
    if out.finished:
        choice.final = out


def _observe_finish(state: ServerState, choice: Choice, out: RequestOutput) -> None:
    ttft = None if choice.first_token_time is None else choice.first_token_time - choice.arrival
    state.metrics.observe_request(
        ttft=ttft, e2e=time.monotonic() - choice.arrival, num_output_tokens=len(out.token_ids),
        queue_time=out.queue_time, finish_reason=out.finish_reason)
    state.metrics.observe_user(choice.user, len(out.prompt_token_ids), len(out.token_ids))
    choice.settle_tokens(state)


def public_finish(state: ServerState, choice: Choice, finish_reason: str | None
                  ) -> tuple[str | None, dict | None]:
    """The finish_reason clients are told, and an error saying why when the server cut the
    answer short. OpenAI's clients know stop / length / tool_calls, not the engine's "abort":
    a cut-short answer is "length" (it ended before its end) plus the error."""
    if finish_reason != FinishReason.ABORT.value:
        return finish_reason, None
    why = choice.cut_reason or ("the server is shutting down" if state.draining
                                else "the request was aborted")
    return FinishReason.LENGTH.value, {"message": f"the answer was cut short: {why}",
                                       "type": "request_cut_short", "param": None, "code": None}


def usage_of(choices: list[Choice]) -> dict:
    prompt_tokens, completion = 0, 0
    seen_prompts = {}
    for c in choices:
        final = c.final
        if final is None:
            continue
        completion += len(final.token_ids)
        best = seen_prompts.get(c.prompt_index)
        if best is None:
            prompt_tokens += len(final.prompt_token_ids)
            seen_prompts[c.prompt_index] = final.num_cached_tokens
        else:
            seen_prompts[c.prompt_index] = max(best, final.num_cached_tokens)
    return usage(prompt_tokens, completion, sum(seen_prompts.values()))


CLIENT_CLOSED = 499  # nginx's status for a client that went away; nobody reads it


async def collect(state: ServerState, http_request: HTTPRequest, choices: list[Choice]) -> bool:
    """Run all choices to completion; abort them if the client disconnects meanwhile.
    Returns False when the client went away."""
    tasks = [asyncio.create_task(_drive(state, c, None)) for c in choices]
    try:
        while not all(t.done() for t in tasks):
            done, _ = await asyncio.wait(tasks, timeout=0.5)
            if await http_request.is_disconnected():
                break
        for t in tasks:
            if t.done() and t.exception():
                raise t.exception()
        return all(c.final is not None for c in choices)
    finally:
        for t in tasks:
            t.cancel()  # cancelling the generator aborts its engine request


async def merged(state: ServerState, choices: list[Choice]
                 ) -> AsyncIterator[tuple[Choice, RequestOutput | QueuePosition]]:
    """Every choice's outputs (and queue positions) as they come, for one stream."""
    sink: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_drive(state, c, sink)) for c in choices]
    remaining = len(choices)
    try:
        while remaining:
            choice, out = await sink.get()
            if isinstance(out, BaseException):
                raise out
            if isinstance(out, RequestOutput) and out.finished:
                remaining -= 1
            yield choice, out
    finally:
        for t in tasks:
            t.cancel()
