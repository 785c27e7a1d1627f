"""Server-sent events for a streamed answer: the endpoint's chunks as `data:` lines, queue
positions as chunks with no choices (an extension OpenAI clients skip), the usage chunk
when asked, errors after the status line in-band, and `data: [DONE]` last."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from pagedllm.core.request import QueuePosition
from pagedllm.core.request import RequestOutput
from pagedllm.server.choice import Choice, usage_of
from pagedllm.server.drive import merged
from pagedllm.server.protocol import now
from pagedllm.server.state import ServerState


@dataclass(frozen=True)
class StreamSpec:
    response_id: str
    model: str
    chunk_object: str  # "text_completion" or "chat.completion.chunk"
    include_usage: bool = False
    first_chunks: tuple[dict, ...] = ()  # sent before any output (chat: the role)


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def named_sse_event(name: str, payload: dict) -> str:
    """An event with its name on an `event:` line (Anthropic's and the Responses API's)."""
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def event_stream(events) -> StreamingResponse:
    """An SSE response, unbuffered by proxies."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sse_response(state: ServerState, choices: list[Choice], spec: StreamSpec,
                 make_chunk: Callable[[Choice, RequestOutput], dict | None]) -> StreamingResponse:
    async def events():
        try:
            for chunk in spec.first_chunks:
                yield sse_event(chunk)
            async for choice, out in merged(state, choices):
                if isinstance(out, QueuePosition):
                    yield sse_event({"id": spec.response_id, "object": "queue.position", "created": now(),
                                     "model": spec.model, "choices": [], "index": choice.index,
                                     "queue_position": out.position, "queue_length": out.queue_length})
                    continue
                chunk = make_chunk(choice, out)
                if chunk is not None:
                    yield sse_event(chunk)
            if spec.include_usage:
                yield sse_event({"id": spec.response_id, "object": spec.chunk_object, "created": now(),
                                 "model": spec.model, "choices": [], "usage": usage_of(choices)})
        except Exception as exc:  # noqa: BLE001 - the status line is sent; report in-band
            yield sse_event({"error": {"message": str(exc), "type": "internal_error",
                                       "param": None, "code": None}})
        yield "data: [DONE]\n\n"

    return event_stream(events())
