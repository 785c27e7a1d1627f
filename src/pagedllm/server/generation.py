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
    first_token_time: float | None = None
    final: RequestOutput | None = None
    outputs: list[RequestOutput] = field(default_factory=list)


def build_choices(state, prompts: list[str | list[int]], params: SamplingParams,
                  user: str | None) -> list[Choice]:
    engine = state.engine
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
            choices.append(Choice(len(choices), p_index, req, arrival))
    return choices


def _child_params(params: SamplingParams, j: int) -> SamplingParams:
    from dataclasses import replace
    return replace(params, n=1, seed=None if params.seed is None else params.seed + j)


async def _drive(state, choice: Choice, sink: asyncio.Queue | None) -> None:
    async for out in state.async_engine.generate(choice.request):
        if choice.first_token_time is None and out.new_token_ids:
            choice.first_token_time = time.monotonic()
        if sink is not None:
            await sink.put((choice, out))
        if out.finished:
            choice.final = out
            end = time.monotonic()
            state.metrics.observe_request(
                ttft=None if choice.first_token_time is None else choice.first_token_time - choice.arrival,
                e2e=end - choice.arrival, num_output_tokens=len(out.token_ids),
                queue_time=out.queue_time, finish_reason=out.finish_reason)


def _usage(choices: list[Choice]) -> dict:
    prompt_tokens, cached, completion = 0, 0, 0
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


async def _merged(state, choices: list[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    sink: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_drive(state, c, sink)) for c in choices]
    remaining = len(choices)
    try:
        while remaining:
            choice, out = await sink.get()
            if out.finished:
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
    choices = build_choices(state, body.prompts(), params, body.user)
    response_id, model = random_id("cmpl"), state.served_model_name

    if body.stream:
        def chunk(choice, out):
            if not out.new_text and not out.finished and not out.new_logprobs:
                return None
            return {"id": response_id, "object": "text_completion", "created": now(), "model": model,
                    "choices": [{"index": choice.index, "text": out.new_text,
                                 "logprobs": _completion_logprobs(state, out.new_logprobs),
                                 "finish_reason": out.finish_reason}]}
        return _stream(state, choices, chunk, None, _include_usage(body), "text_completion",
                       response_id, model)

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
    choices = build_choices(state, [prompt_ids], params, body.user)
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
        return _stream(state, choices, chunk, first, _include_usage(body),
                       "chat.completion.chunk", response_id, model)

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
