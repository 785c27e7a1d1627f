"""POST /v1/completions and /v1/chat/completions: requests in, engine streams out.

Each prompt x n becomes one engine request (the n samples share the prompt's KV blocks
through the prefix cache). Streaming answers are SSE chunks ending with `data: [DONE]`;
a client that goes away aborts its requests.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.async_engine import QueuePosition
from pagedllm.engine import PromptTooLongError
from pagedllm.request import RequestOutput, SamplingParams, SamplingParamsError
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import (ChatCompletionRequest, CompletionRequest, now, random_id,
                                      usage)
from pagedllm.tokenizer import ChatTemplateError


@dataclass
class Choice:
    """One engine request answering one choice; tracks what the client has seen."""

    index: int
    prompt_index: int
    request: object
    arrival: float
    stream: object = None  # the RequestStream once submitted
    first_token_time: float | None = None
    user: str = ""
    key: object = None
    final: RequestOutput | None = None


def build_choices(state, prompts: list[str | list[int]], params: SamplingParams,
                  http_request: HTTPRequest, user_field: str | None) -> list[Choice]:
    """Check limits and make one engine request per prompt x n (nothing is queued yet)."""
    engine = state.engine
    options = state.options
    user, key = state.identity(http_request, user_field)
    if options.max_tokens_limit and params.max_tokens and params.max_tokens > options.max_tokens_limit:
        raise APIError(400, f"max_tokens {params.max_tokens} is over this server's limit of "
                            f"{options.max_tokens_limit}", "max_tokens", "invalid_value")
    state.admit(user, key, len(prompts) * params.n)
    choices = []
    arrival = time.monotonic()
    for p_index, prompt in enumerate(prompts):
        for j in range(params.n):
            child = params if params.n == 1 else _child_params(params, j)
            try:
                req = engine.make_request(random_id("req"), prompt, child, user=user,
                                          cache_salt=state.cache_salt_for(user))
            except PromptTooLongError as exc:
                raise APIError(400, str(exc), "max_tokens", "context_length_exceeded") from exc
            except SamplingParamsError as exc:
                raise APIError(400, str(exc), exc.param, "invalid_value") from exc
            except ValueError as exc:
                raise APIError(400, str(exc), "prompt", "invalid_value") from exc
            limit = options.max_prompt_tokens
            if limit and req.num_prompt_tokens > limit:
                raise APIError(400, f"the prompt has {req.num_prompt_tokens} tokens, over this "
                                    f"server's limit of {limit}", "prompt", "prompt_too_long")
            choices.append(Choice(len(choices), p_index, req, arrival, user=user, key=key))
    return choices


def submit_choices(state, choices: list[Choice], report_position: bool = False) -> None:
    """Queue every choice's request, with no await between the queue check and this."""
    for choice in choices:
        choice.stream = state.async_engine.submit(choice.request, report_position)


def _child_params(params: SamplingParams, j: int) -> SamplingParams:
    from dataclasses import replace
    return replace(params, n=1, seed=None if params.seed is None else params.seed + j)


async def _drive(state, choice: Choice, sink: asyncio.Queue | None) -> None:
    timeout = state.options.request_timeout
    timer = None
    if timeout:
        # An abort ends the stream with finish_reason "abort", like any other abort.
        timer = asyncio.get_running_loop().call_later(
            timeout, state.async_engine.abort, choice.request.request_id)
    try:
        async for out in choice.stream:
            if isinstance(out, QueuePosition):
                if sink is not None:
                    await sink.put((choice, out))
                continue
            await _on_output(state, choice, out, sink)
    finally:
        if timer is not None:
            timer.cancel()


async def _on_output(state, choice: Choice, out: RequestOutput, sink) -> None:
    if choice.first_token_time is None and out.new_token_ids:
        choice.first_token_time = time.monotonic()
    if sink is not None:
        await sink.put((choice, out))
    if not out.finished:
        return
    choice.final = out
    ttft = None if choice.first_token_time is None else choice.first_token_time - choice.arrival
    state.metrics.observe_request(
        ttft=ttft, e2e=time.monotonic() - choice.arrival, num_output_tokens=len(out.token_ids),
        queue_time=out.queue_time, finish_reason=out.finish_reason)
    state.metrics.observe_user(choice.user, len(out.prompt_token_ids), len(out.token_ids))
    if choice.key is not None:
        state.rate_limiter.record(choice.key.name, len(out.prompt_token_ids) + len(out.token_ids))


def _usage(choices: list[Choice]) -> dict:
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


async def _collect(state, http_request: HTTPRequest, choices: list[Choice]) -> bool:
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


async def _merged(state, choices: list[Choice]
                  ) -> AsyncIterator[tuple[Choice, RequestOutput | QueuePosition]]:
    sink: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_drive(state, c, sink)) for c in choices]
    remaining = len(choices)
    try:
        while remaining:
            choice, out = await sink.get()
            if isinstance(out, RequestOutput) and out.finished:
                remaining -= 1
            yield choice, out
    finally:
        for t in tasks:
            t.cancel()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _stream(state, choices, make_chunk, first_chunks=None, include_usage=False,
            object_name="", response_id="", model="") -> StreamingResponse:
    async def events():
        try:
            for chunk in first_chunks or []:
                yield _sse(chunk)
            async for choice, out in _merged(state, choices):
                if isinstance(out, QueuePosition):
                    # Extension: a chunk with no choices, which OpenAI clients skip.
                    yield _sse({"id": response_id, "object": "queue.position", "created": now(),
                                "model": model, "choices": [], "index": choice.index,
                                "queue_position": out.position, "queue_length": out.queue_length})
                    continue
                chunk = make_chunk(choice, out)
                if chunk is not None:
                    yield _sse(chunk)
            if include_usage:
                yield _sse({"id": response_id, "object": object_name, "created": now(),
                            "model": model, "choices": [], "usage": _usage(choices)})
        except Exception as exc:  # noqa: BLE001 - the status line is sent; report in-band
            yield _sse({"error": {"message": str(exc), "type": "internal_error",
                                  "param": None, "code": None}})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- completions ---------------------------------------------------------------------------

def _completion_logprobs(state, outs_logprobs, text_offset_start: int = 0):
    if outs_logprobs is None:
        return None
    tok = state.engine.tokenizer
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset_start
    for lp in outs_logprobs:
        text = tok.token_text(lp.token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top.append({tok.token_text(t): v for t, v in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


async def create_completion(state, body: CompletionRequest, http_request: HTTPRequest):
    state.check_model(body.model)
    if body.echo:
        raise APIError(400, "echo is not supported", "echo", "unsupported")
    params = _params(body, body.max_tokens, body.logprobs)
    choices = build_choices(state, body.prompts(), params, http_request, body.user)
    response_id, model = random_id("cmpl"), state.served_model_name

    if body.stream:
        def chunk(choice, out):
            if not out.new_text and not out.finished and not out.new_logprobs:
                return None
            return {"id": response_id, "object": "text_completion", "created": now(), "model": model,
                    "choices": [{"index": choice.index, "text": out.new_text,
                                 "logprobs": _completion_logprobs(state, out.new_logprobs),
                                 "finish_reason": out.finish_reason}]}
        submit_choices(state, choices, body.queue_position)
        return _stream(state, choices, chunk, None, _include_usage(body), "text_completion",
                       response_id, model)

    submit_choices(state, choices)
    if not await _collect(state, http_request, choices):
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse({
        "id": response_id, "object": "text_completion", "created": now(), "model": model,
        "choices": [{"index": c.index, "text": c.final.text,
                     "logprobs": _completion_logprobs(state, c.final.logprobs),
                     "finish_reason": c.final.finish_reason} for c in choices],
        "usage": _usage(choices)})


# -- chat ----------------------------------------------------------------------------------

def _chat_logprobs(state, lps):
    if lps is None:
        return None
    tok = state.engine.tokenizer

    def entry(token_id, logprob):
        text = tok.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}


async def create_chat_completion(state, body: ChatCompletionRequest, http_request: HTTPRequest):
    state.check_model(body.model)
    try:
        prompt = state.engine.tokenizer.apply_chat_template(
            body.template_messages(), add_generation_prompt=body.add_generation_prompt)
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), "messages", "invalid_value") from exc
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = _params(body, body.max_completion_tokens or body.max_tokens, top)
    # The template writes special tokens as text; encode without adding BOS twice.
    prompt_ids = state.engine.tokenizer.encode(prompt, add_special_tokens=False)
    choices = build_choices(state, [prompt_ids], params, http_request, body.user)
    response_id, model = random_id("chatcmpl"), state.served_model_name
    base = {"id": response_id, "object": "chat.completion.chunk", "model": model}

    if body.stream:
        first = [{**base, "created": now(), "choices": [
            {"index": c.index, "delta": {"role": "assistant", "content": ""},
             "logprobs": None, "finish_reason": None} for c in choices]}]

        def chunk(choice, out):
            if not out.new_text and not out.finished and not out.new_logprobs:
                return None
            delta = {"content": out.new_text} if out.new_text else {}
            return {**base, "created": now(), "choices": [
                {"index": choice.index, "delta": delta,
                 "logprobs": _chat_logprobs(state, out.new_logprobs),
                 "finish_reason": out.finish_reason}]}
        submit_choices(state, choices, body.queue_position)
        return _stream(state, choices, chunk, first, _include_usage(body),
                       "chat.completion.chunk", response_id, model)

    submit_choices(state, choices)
    if not await _collect(state, http_request, choices):
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse({
        "id": response_id, "object": "chat.completion", "created": now(), "model": model,
        "choices": [{"index": c.index,
                     "message": {"role": "assistant", "content": c.final.text},
                     "logprobs": _chat_logprobs(state, c.final.logprobs),
                     "finish_reason": c.final.finish_reason} for c in choices],
        "usage": _usage(choices)})


def _params(body, max_tokens, logprobs) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs)
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_value") from exc


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)
