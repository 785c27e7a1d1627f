"""Driving submitted choices to their end: each choice's stream read, its first token and
finish observed in metrics, its token reservation settled, a timeout enforced; merged into
one stream for SSE/NDJSON, or collected for a JSON answer. A client that goes away aborts
its requests."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request as HTTPRequest

from pagedllm.core.request import QueuePosition, RequestOutput
from pagedllm.errors import AdapterError, EngineDeadError
from pagedllm.server.choice import Choice
from pagedllm.server.errors import APIError
from pagedllm.server.state import ServerState


async def _drive(state: ServerState, choice: Choice, sink: asyncio.Queue | None) -> None:
    timeout = state.config.request_timeout
    timer = None
    if timeout:
        def cut_short():
            choice.cut_reason = f"it ran past this server's request timeout of {timeout:g} s"
            state.client.abort(choice.request.request_id)
        timer = asyncio.get_running_loop().call_later(timeout, cut_short)
    try:
        async for out in choice.stream:
            if isinstance(out, QueuePosition):
                if sink is not None:
                    await sink.put((choice, out))
                continue
            await _on_output(state, choice, out, sink)
    except EngineDeadError as exc:  # a crash or a stall: a stream ends with a finish and why
        if sink is None:
            raise
        await _on_output(state, choice, choice.cut_by(exc), sink)
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
    choice.latest = out
    if out.finished:
        _observe_finish(state, choice, out)
    if out.error is not None:  # counted above like any finish; the client gets the error
        adapter_gone = out.error.removeprefix(f"{AdapterError.__name__}: ")
        if adapter_gone != out.error:  # unloaded between the request's check and its start
            raise APIError(404, f"{adapter_gone}: it was unloaded as this request arrived",
                           "model", "model_not_found")
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
        queue_time=out.queue_time, finish_reason=out.finish_reason,
        model=state.served_model_name)
    state.metrics.observe_user(choice.user, len(out.prompt_token_ids), len(out.token_ids),
                               is_key=choice.key is not None)
    choice.settle_tokens(state)


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


async def outputs(state: ServerState, choices: list[Choice]
                  ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Every choice's outputs as they come, without the queue positions (for the APIs that
    have no way to say them)."""
    async for choice, out in merged(state, choices):
        if not isinstance(out, QueuePosition):
            yield choice, out


async def merged(state: ServerState, choices: list[Choice]
                 ) -> AsyncIterator[tuple[Choice, RequestOutput | QueuePosition]]:
    """Every choice's outputs (and queue positions) as they come, for one stream. A choice
    its engine stopped serving (a crash, a stall) ends like the rest, with a finish and why;
    then the engine's error is raised, for the stream's in-band error."""
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
        failure = next((c.failure for c in choices if c.failure is not None), None)
        if failure is not None:  # after every finish: each API then says it in-band too
            raise failure
    finally:
        for t in tasks:
            t.cancel()
