"""POST /v1/completions and /v1/chat/completions: OpenAI requests in, OpenAI answers out
(streamed as SSE chunks ending with `data: [DONE]`, or as one JSON body)."""
from __future__ import annotations

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from pagedllm.request import SamplingParams, SamplingParamsError
from pagedllm.server.choices import (CLIENT_CLOSED, build_choices, collect, sse_response,
                                     submit_choices, usage_of)
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest, now, random_id
from pagedllm.tokenizer import ChatTemplateError


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
        return sse_response(state, choices, chunk, None, _include_usage(body), "text_completion",
                       response_id, model)

    submit_choices(state, choices)
    if not await collect(state, http_request, choices):
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse({
        "id": response_id, "object": "text_completion", "created": now(), "model": model,
        "choices": [{"index": c.index, "text": c.final.text,
                     "logprobs": _completion_logprobs(state, c.final.logprobs),
                     "finish_reason": c.final.finish_reason} for c in choices],
        "usage": usage_of(choices)})


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
        return sse_response(state, choices, chunk, first, _include_usage(body),
                       "chat.completion.chunk", response_id, model)

    submit_choices(state, choices)
    if not await collect(state, http_request, choices):
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse({
        "id": response_id, "object": "chat.completion", "created": now(), "model": model,
        "choices": [{"index": c.index,
                     "message": {"role": "assistant", "content": c.final.text},
                     "logprobs": _chat_logprobs(state, c.final.logprobs),
                     "finish_reason": c.final.finish_reason} for c in choices],
        "usage": usage_of(choices)})


def _params(body, max_tokens, logprobs) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs)
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_value") from exc


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)
