"""A streamed request with `queue_position: true` to a store's model that is not loaded yet:
the answer starts at once, and while the model loads the stream carries the queue-position
extension's chunks with `"loading": true` (docs/apis.md, "Extension: queue position"); then the
request goes on as any other and its own stream follows in the same response.

Once the status line is sent, what goes wrong (the load, a field the answer's preparation
refuses) comes in-band as an error chunk, as for any stream. A client that goes away while
the model loads gives back its lease when the load ends."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi.responses import Response

from pagedllm.server.errors import APIError
from pagedllm.server.protocol import now
from pagedllm.server.sse import event_stream, sse_event
from pagedllm.server.state import ServerState

LOADING_INTERVAL_S = 1.0


def stream_while_loading(state: ServerState, model: str | None,
                         answer: Callable[[ServerState], Awaitable[Response]]) -> Response | None:
    """The loading stream when `model` is a store's, not loaded yet; else None (the caller
    serves the request as usual). `answer(view)` is the request's own work."""
    if state.pool is None or not model:
        return None
    state.check_model(model)
    entry = state.pool.catalog.find(model)
    if entry.kind != "chat" or state.pool.get(entry.name) is not None:
        return None

    async def events():
        acquiring = asyncio.ensure_future(state.acquire(model))
        handed_over = False
        try:
            while True:
                yield sse_event({"object": "queue.position", "created": now(), "model": model,
                                 "choices": [], "queue_position": 1, "queue_length": 1,
                                 "loading": True})
                done, _ = await asyncio.wait({acquiring}, timeout=LOADING_INTERVAL_S)
                if done:
                    break
            loaded = acquiring.result()  # an APIError here is reported below
            handed_over = True
            try:
                response = await answer(state.view(loaded))
            finally:
                state.pool.release(loaded)
        except APIError as exc:
            yield sse_event({"error": {"message": exc.message, "type": "invalid_request_error"
                                       if exc.status < 500 else "internal_error",
                                       "param": exc.param, "code": exc.code}})
            yield "data: [DONE]\n\n"
            return
        finally:
            if not handed_over:  # the client left while loading: the lease goes back
                acquiring.add_done_callback(_release_when_loaded(state))
        body = getattr(response, "body_iterator", None)
        if body is None:  # not a stream (cannot happen for stream: true; kept whole)
            yield response.body.decode()
            return
        async for part in body:
            yield part

    return event_stream(events())


def _release_when_loaded(state: ServerState):
    def release(task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            state.pool.release(task.result())
    return release
