"""POST /v1/completions and /v1/chat/completions: how each request body becomes a Job
(prompts and sampling parameters) and how each answer looks (an `Endpoint` record each);
the pipeline (pipeline.py) does the rest."""
from __future__ import annotations

from fastapi import Request as HTTPRequest

from pagedllm.core.request import RequestOutput
from pagedllm.server.answer_parts import AnswerParts, whole_answer
from pagedllm.server.chat_prompt import ChatPrompt, prepare_chat
from pagedllm.server.choice import Choice
from pagedllm.server.endpoint import Endpoint, OpenAIShape
from pagedllm.server.errors import APIError
from pagedllm.server.loading_stream import stream_while_loading
from pagedllm.server.pipeline import Job, run
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.server.state import ServerState


# -- completions ---------------------------------------------------------------------------

def _completion_logprobs(state: ServerState, outs_logprobs, text_offset_start: int = 0):
    if outs_logprobs is None:
        return None
    tok = state.client.tokenizer
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


async def _routed(state: ServerState, body, answer):
    """`answer(view)` on the view of the model the body names; a stream that reports queue
    positions hears meanwhile that a store's model is loading (loading_stream.py)."""
    if body.stream and body.queue_position:
        loading = stream_while_loading(state, body.model, answer)
        if loading is not None:
            return loading
    async with state.serving(body.model) as served:
        return await answer(served.with_lora_field(body.lora))


async def create_completion(state: ServerState, body: CompletionRequest, http_request: HTTPRequest):
    return await _routed(state, body, lambda served: _completion(served, body, http_request))


async def _completion(state: ServerState, body: CompletionRequest, http_request: HTTPRequest):
    if body.echo:
        raise APIError(400, "echo is not supported", "echo", "unsupported")
    params = body.sampling_params(body.max_tokens, body.logprobs)
    job = Job(body.prompts(), params, body.stream, body.user, report_position=body.queue_position)
    return await run(state, http_request, job, OpenAIShape(completion_endpoint(state),
                                                           body.include_usage()))


# -- chat ----------------------------------------------------------------------------------
def _chat_logprobs(state: ServerState, lps):
    if lps is None:
        return None
    tok = state.client.tokenizer

    def entry(token_id, logprob):
        text = tok.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}


def chat_endpoint(state: ServerState, prompt: ChatPrompt) -> Endpoint:
    """Chat answers read as they come (server/answer_parts.py): a reasoning model's thinking
    as `reasoning_content` (vLLM's and DeepSeek's field), content without it, tool calls
    each whole in one delta (index, id, name, arguments), as OpenAI's clients reassemble
    them; finish_reason "tool_calls" when the answer made any."""
    parts: dict[int, AnswerParts] = {}
    reasons = prompt.thinking is not None

    def chunk_choice(c: Choice, out: RequestOutput) -> dict | None:
        reader = parts.setdefault(c.index, AnswerParts(prompt.tools, prompt.thinking))
        before = len(reader.calls)
        piece = reader.feed(out.new_text, out.finished, out.finish_reason == "length")
        delta = {"reasoning_content": piece.thinking} if piece.thinking else {}
        if piece.text:
            delta["content"] = piece.text
        if piece.calls:
            delta["tool_calls"] = [call.as_openai(index=before + i)
                                   for i, call in enumerate(piece.calls)]
        if not delta and not out.finished and not out.new_logprobs:
            return None
        return {"index": c.index, "delta": delta,
                "logprobs": _chat_logprobs(state, out.new_logprobs),
                "finish_reason": _finish_reason(out.finish_reason, reader.calls)}

    def final_choice(c: Choice) -> dict:
        answer = whole_answer(c.final.text, c.final.finish_reason == "length", prompt.tools,
                              prompt.thinking)
        message = {"role": "assistant",
                   "content": answer.text or (None if answer.calls else answer.text)}
        if reasons:
            message["reasoning_content"] = answer.thinking or None
        if answer.calls:
            message["tool_calls"] = [call.as_openai() for call in answer.calls]
        return {"index": c.index, "message": message,
                "logprobs": _chat_logprobs(state, c.final.logprobs),
                "finish_reason": _finish_reason(c.final.finish_reason, answer.calls)}

    return Endpoint("chatcmpl", "chat.completion", "chat.completion.chunk", chunk_choice,
                    final_choice, first_delta={"role": "assistant", "content": ""})


def _finish_reason(reason: str | None, calls: list) -> str | None:
    return "tool_calls" if reason == "stop" and calls else reason


async def create_chat_completion(state: ServerState, body: ChatCompletionRequest, http_request: HTTPRequest):
    return await _routed(state, body,
                         lambda served: _chat_completion(served, body, http_request))


async def _chat_completion(state: ServerState, body: ChatCompletionRequest,
                           http_request: HTTPRequest):
    top = (body.top_logprobs or 0) if body.logprobs else None
    prompt, params = await prepare_chat(
        state, body.template_messages(),
        body.sampling_params(body.max_completion_tokens or body.max_tokens, top),
        tools=body.tools, tool_choice=body.tool_choice,
        add_generation_prompt=body.generation_prompt(),
        continue_final=body.continue_final_message,
        parallel_tool_calls=body.parallel_tool_calls,
        template_options=body.template_options(state.client.tokenizer.template_variables))
    job = Job([prompt.token_ids], params, body.stream, body.user,
              report_position=body.queue_position, api="openai.chat")
    return await run(state, http_request, job, OpenAIShape(chat_endpoint(state, prompt),
                                                           body.include_usage()))
