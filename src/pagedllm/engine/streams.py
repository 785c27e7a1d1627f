"""A submitted request's stream, as both transports give it to the server: the engine's
thread or the front end's reader puts the request's outputs (and queue positions, when
asked) on an asyncio queue on the server's event loop, and the server iterates them.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pagedllm.core.request import QueuePosition, RequestOutput


@dataclass
class StreamQueue:
    """Where a request's items go: its event loop's queue; the last position it was told."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    report_position: bool = False
    last_position: int | None = None

    @classmethod
    def on_running_loop(cls, report_position: bool = False) -> StreamQueue:
        return cls(asyncio.get_running_loop(), asyncio.Queue(), report_position)


class RequestStream:
    """The outputs of one submitted request (and, if asked, its queue position while it
    waits). Leaving the iteration early (a client disconnect) aborts the request."""

    def __init__(self, abort: Callable[[str], None], request_id: str, stream: StreamQueue):
        self._abort = abort
        self.request_id = request_id
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[RequestOutput | QueuePosition]:
        finished = False
        try:
            while True:
                item = await self._stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, RequestOutput) and item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._abort(self.request_id)

    async def batches(self) -> AsyncIterator[list[RequestOutput | QueuePosition]]:
        """As iteration, but everything already delivered comes at once: a reader slower
        than the engine (a replica's transport) takes several steps' outputs in one go."""
        finished = False
        try:
            while True:
                items = [await self._stream.queue.get()]
                while not self._stream.queue.empty():
                    items.append(self._stream.queue.get_nowait())
                for i, item in enumerate(items):
                    if isinstance(item, BaseException):
                        if i:
                            yield items[:i]
                        raise item
                yield items
                if any(isinstance(item, RequestOutput) and item.finished for item in items):
                    finished = True
                    return
        finally:
            if not finished:
                self._abort(self.request_id)


def deliver_on(loop: asyncio.AbstractEventLoop, puts: list) -> None:
    """(asyncio.Queue, item) pairs put on their queues by one callback on `loop`."""
    def put_all():
        for target, item in puts:
            target.put_nowait(item)
    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the event loop is gone (the server is shutting down)
        pass


def deliver_all(items: list[tuple[StreamQueue, object]]) -> None:
    """(stream, item) pairs onto their streams: one hop onto each event loop for all of a
    step's outputs, not one a request."""
    by_loop: dict = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, puts in by_loop.items():
        deliver_on(loop, puts)
