"""The engine loop thread and per-request asyncio streams.

HTTP handlers never touch the engine's state: they post commands (AddRequest, AbortRequest,
AbortAll, SetUserPolicies, TakeSnapshot) to a thread-safe queue and read their own asyncio.Queue of RequestOutputs. One thread owns the engine and
runs step() while there is work, applying commands between steps, so an abort frees the
request's blocks within one step.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedllm.engine.engine import LLMEngine
from pagedllm.errors import EngineDeadError
from pagedllm.core.request import FinishReason, QueuePosition, Request, RequestOutput
from pagedllm.core.snapshot import EngineSnapshot

logger = logging.getLogger("pagedllm.async")
MAX_CONSECUTIVE_FAULTS = 3  # engine steps failing in a row before the engine counts as dead


# Commands from the HTTP side to the loop thread, applied between steps in the order sent.
@dataclass(frozen=True)
class AddRequest:
    request: Request


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class AbortAll:
    pass


@dataclass(frozen=True)
class SetUserPolicies:
    weights: dict[str, float]
    max_running: dict[str, int]


@dataclass(frozen=True)
class TakeSnapshot:
    """Answered on the loop thread between steps (never mid-step)."""
    future: concurrent.futures.Future


Command = AddRequest | AbortRequest | AbortAll | SetUserPolicies | TakeSnapshot


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    report_position: bool = False
    last_position: int | None = None


class RequestStream:
    """The outputs of one submitted request (and, if asked, its queue position while it
    waits). Leaving the iteration early (a client disconnect) aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream):
        self._engine = engine
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
                self._engine.abort(self.request_id)

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
                self._engine.abort(self.request_id)


def deliver_on(loop: asyncio.AbstractEventLoop, puts: list) -> None:
    """(asyncio.Queue, item) pairs put on their queues by one callback on `loop`."""
    def put_all():
        for target, item in puts:
            target.put_nowait(item)
    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the event loop is gone (the server is shutting down)
        pass


class AsyncEngine:
    """With start_thread=True the loop runs in its own thread; the server instead calls
    run_loop() on the main thread, where torch's CPU kernels run ~1.4x faster per step than
    on another thread (measured: BENCHMARKS.md), and serves HTTP from a helper thread."""

    def __init__(self, engine: LLMEngine, start_thread: bool = True):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopped = False
        self.consecutive_faults = 0
        # Called on the loop thread before each step (a model store sets the step's compute
        # threads by what the other models are doing: serving/model_pool.py).
        self.before_step = None
        self.dead: str | None = None  # why the engine is unusable, once it is (run_loop ends)
        self._thread = None
        if start_thread:
            self._thread = threading.Thread(target=self.run_loop, name="pagedllm-engine", daemon=True)
            self._thread.start()

    # -- called from the event loop -------------------------------------------------------
    def submit(self, request: Request, report_position: bool = False) -> RequestStream:
        """Queue a request made with engine.make_request. Synchronous, so a caller that
        checks queue room and submits without awaiting in between cannot be overtaken."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), report_position)
        self._streams[request.request_id] = stream
        self._post(AddRequest(request))
        return RequestStream(self, request.request_id, stream)

    def abort(self, request_id: str) -> None:
        self._post(AbortRequest(request_id))

    def abort_all(self) -> None:
        """Abort every request; each stream gets a final output with finish_reason 'abort'."""
        self._post(AbortAll())

    async def snapshot(self, timeout: float = 30.0) -> EngineSnapshot:
        """The engine's state between two steps (blocks, requests, fair share)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(TakeSnapshot(future))
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    def set_user_policies(self, weights: dict[str, float], max_running: dict[str, int]) -> None:
        """Fair-share weights and per-user running caps, applied by the loop thread."""
        self._post(SetUserPolicies(dict(weights), dict(max_running)))

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopped = True
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _post(self, command: Command) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # -- the engine thread ----------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list) -> None:
        """(request id, item) pairs onto their streams: one hop onto each event loop for all
        of a step's outputs, not one a request."""
        by_loop: dict = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if isinstance(item, BaseException) or (isinstance(item, RequestOutput)
                                                   and item.finished):
                del self._streams[request_id]
            by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, puts in by_loop.items():
            deliver_on(loop, puts)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AddRequest):
                if command.request.request_id in self._streams:  # not aborted meanwhile
                    self._add(command.request)
            elif isinstance(command, AbortRequest):
                self._abort(command.request_id)
            elif isinstance(command, AbortAll):
                for request_id in self.engine.request_ids():
                    self._abort(request_id)
            elif isinstance(command, SetUserPolicies):
                self.engine.set_user_policies(command.weights, command.max_running)
            elif isinstance(command, TakeSnapshot):
                # The asker may be gone (a closed page cancels its wait): then there is no
                # one to answer, and answering a cancelled future would raise here.
                if not command.future.set_running_or_notify_cancel():
                    continue
                try:
                    command.future.set_result(self.engine.snapshot())
                except Exception as exc:  # noqa: BLE001 - the asker hears it; the loop goes on
                    command.future.set_exception(exc)

    def _add(self, request: Request) -> None:
        """Add the request; if the engine refuses it now (its adapter was unloaded since it
        was made), its stream ends with that error at once."""
        try:
            self.engine.add(request)
        except Exception as exc:  # noqa: BLE001 - this request fails, the rest go on
            self._deliver(request.request_id, RequestOutput(
                request.request_id, request.prompt_token_ids, [], "", [], "", True,
                FinishReason.ERROR.value, error=f"{type(exc).__name__}: {exc}"))

    def _abort(self, request_id: str) -> None:
        final = self.engine.abort_request(request_id)
        if final is not None:
            self._deliver(request_id, final)

    def _report_positions(self) -> None:
        if not any(s.report_position for s in self._streams.values()):
            return
        order = self.engine.queue_positions()
        for position, request_id in enumerate(order, 1):
            stream = self._streams.get(request_id)
            if stream is not None and stream.report_position and stream.last_position != position:
                stream.last_position = position
                self._deliver(request_id, QueuePosition(position, len(order)))

    def run_loop(self) -> None:
        """Apply commands and step while there is work, until shutdown()."""
        while not self._stopped:
            self._apply_commands()
            self._report_positions()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                if self.before_step is not None:
                    self.before_step()
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - outside any one request (a scheduler fault)
                self._on_engine_fault(exc)
                continue
            self.consecutive_faults = 0
            self._deliver_all([(output.request_id, output) for output in outputs])
            time.sleep(0)  # let the HTTP thread run between steps

    def _on_engine_fault(self, exc: Exception) -> None:
        """A step failed outside any one request's work (those fail alone, in the engine):
        every request ends with an error, never silently; repeated faults mean the engine is
        unusable: `dead` is set (for /health and serve(), which exits) and the loop ends."""
        self.consecutive_faults += 1
        logger.exception("engine step failed (%d in a row); failing every request",
                         self.consecutive_faults)
        for request_id in list(self._streams):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - the stream still gets its error below
                logger.exception("could not free request %s", request_id)
            self._deliver(request_id, EngineDeadError(f"engine error: {type(exc).__name__}: {exc}"))
        if self.consecutive_faults >= MAX_CONSECUTIVE_FAULTS:
            self.dead = f"{self.consecutive_faults} engine steps failed in a row: {exc}"
            logger.critical("engine unusable: %s", self.dead)
            self._stopped = True
