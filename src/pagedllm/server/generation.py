"""POST /v1/completions and /v1/chat/completions: what each answer looks like (an `Endpoint`
record each) and how each request becomes prompts and sampling parameters; the driver
(endpoint.py) does the rest, streamed as SSE chunks ending with `data: [DONE]` or as one
JSON body."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request as HTTPRequest

from pagedllm.core.request import SamplingParams, SamplingParamsError
from pagedllm.server.endpoint import Endpoint, answer
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.structured.spec import GrammarError
from pagedllm.tokenizer import ChatTemplateError

if TYPE_CHECKING:  # app.py imports this module
    from pagedllm.server.app import ServerState


# -- completions ---------------------------------------------------------------------------

def _completion_logprobs(state: ServerState, outs_logprobs, text_offset_start: int = 0):
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


def completion_endpoint(state: ServerState) -> Endpoint:
    return Endpoint(
        "cmpl", "text_completion", "text_completion",
        chunk_choice=lambda c, out: {"index": c.index, "text": out.new_text,
                                     "logprobs": _completion_logprobs(state, out.new_logprobs),
                                     "finish_reason": out.finish_reason},
        final_choice=lambda c: {"index": c.index, "text": c.final.text,
                                "logprobs": _completion_logprobs(state, c.final.logprobs),
                                "finish_reason": c.final.finish_reason})


async def create_completion(state: ServerState, body: CompletionRequest, http_request: HTTPRequest):
    state.check_model(body.model)
    if body.echo:
        raise APIError(400, "echo is not supported", "echo", "unsupported")
    params = _params(body, body.max_tokens, body.logprobs)
    return await answer(state, completion_endpoint(state), body, body.prompts(), params, http_request)


# -- chat ----------------------------------------------------------------------------------

def _chat_logprobs(state: ServerState, lps):
    if lps is None:
        return None
    tok = state.engine.tokenizer

    def entry(token_id, logprob):
        text = tok.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}


def chat_endpoint(state: ServerState) -> Endpoint:
    return Endpoint(
        "chatcmpl", "chat.completion", "chat.completion.chunk",
        chunk_choice=lambda c, out: {"index": c.index,
                                     "delta": {"content": out.new_text} if out.new_text else {},
                                     "logprobs": _chat_logprobs(state, out.new_logprobs),
                                     "finish_reason": out.finish_reason},
        final_choice=lambda c: {"index": c.index,
                                "message": {"role": "assistant", "content": c.final.text},
                                "logprobs": _chat_logprobs(state, c.final.logprobs),
                                "finish_reason": c.final.finish_reason},
        first_delta={"role": "assistant", "content": ""})


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, http_request: HTTPRequest):
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
    return await answer(state, chat_endpoint(state), body, [prompt_ids], params, http_request)


def _params(body, max_tokens, logprobs) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs)
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_value") from exc
    except GrammarError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_grammar") from exc
