"""The engine core's in-process transport: one loop thread and per-request asyncio streams.

HTTP handlers never touch the engine's state: they post made requests and engine/wire.py
messages (aborts, policies, snapshot asks) to a thread-safe queue and read their own
stream (engine/streams.py). One thread owns the engine core (engine/core.py), hands it the
commands between steps, in the order sent, and steps while there is work, so an abort
frees the request's blocks within one step.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time

from pagedllm.core.request import QueuePosition, Request
from pagedllm.core.snapshot import EngineSnapshot
from pagedllm.engine import wire
from pagedllm.engine.core import CoreOutputs, EngineCore
from pagedllm.engine.engine import LLMEngine
from pagedllm.engine.streams import RequestStream, StreamQueue, deliver_all
from pagedllm.errors import EngineDeadError

__all__ = ["AsyncEngine", "QueuePosition", "RequestStream"]


class AsyncEngine:
    """With start_thread=True the loop runs in its own thread; the server instead calls
    run_loop() on the main thread, where torch's CPU kernels run ~1.4x faster per step than
    on another thread (measured: BENCHMARKS.md), and serves HTTP from a helper thread."""

    def __init__(self, engine: LLMEngine, start_thread: bool = True):
        self.engine = engine
        self.core = EngineCore(engine)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # Request | wire.ToEngine
        self._wakeup = threading.Event()
        self._streams: dict[str, StreamQueue] = {}
        self._asks: dict[int, concurrent.futures.Future] = {}
        self._ask_ids = itertools.count()
        self._stopped = False
        self._thread = None
        if start_thread:
            self._thread = threading.Thread(target=self.run_loop, name="pagedllm-engine", daemon=True)
            self._thread.start()

    @property
    def dead(self) -> str | None:
        """Why the engine is unusable, once it is (run_loop has ended)."""
        return self.core.dead

    @property
    def before_step(self):
        return self.core.before_step

    @before_step.setter
    def before_step(self, hook) -> None:
        self.core.before_step = hook

    # -- called from the event loop -------------------------------------------------------
    def submit(self, request: Request, report_position: bool = False) -> RequestStream:
        """Queue a request made with engine.make_request. Synchronous, so a caller that
        checks queue room and submits without awaiting in between cannot be overtaken."""
        stream = StreamQueue.on_running_loop(report_position)
        self._streams[request.request_id] = stream
        self._post(request)
        return RequestStream(self.abort, request.request_id, stream)

    def abort(self, request_id: str) -> None:
        self._post(wire.AbortRequests([request_id]))

    def abort_all(self) -> None:
        """Abort every request; each stream gets a final output with finish_reason 'abort'."""
        self._post(wire.AbortAll())

    async def snapshot(self, timeout: float = 30.0) -> EngineSnapshot:
        """The engine's state between two steps (blocks, requests, fair share)."""
        future = self.ask_snapshot()
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    def ask_snapshot(self) -> concurrent.futures.Future:
        """A future the loop thread answers between steps (never mid-step); an asker that
        went away meanwhile cancels it, and is then not answered."""
        ask_id = next(self._ask_ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._asks[ask_id] = future
        self._post(wire.AskSnapshot(ask_id))
        return future

    def set_user_policies(self, weights: dict[str, float], max_running: dict[str, int]) -> None:
        """Fair-share weights and per-user running caps, applied by the loop thread."""
        self._post(wire.SetUserPolicies(dict(weights), dict(max_running)))

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopped = True
        self._wakeup.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _post(self, command: Request | wire.ToEngine) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # -- the engine thread ----------------------------------------------------------------
    def run_loop(self) -> None:
        """Hand the core its commands and step while there is work, until shutdown() (or
        the core is dead)."""
        core = self.core
        while not self._stopped and not core.stopped:
            self._apply_commands()
            # What the commands produced (an abort's final output, positions as they stand
            # now: a request admitted by the next step was first told it waits) goes out
            # before the step.
            self._deliver(core.take())
            if not core.has_work:
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            core.step()
            self._deliver(core.take())
            if core.dead is not None:
                self._stopped = True
            time.sleep(0)  # let the HTTP thread run between steps

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Request):
                stream = self._streams.get(command.request_id)
                if stream is not None:  # not aborted (or failed) meanwhile
                    self.core.add(command, stream.report_position)
            else:
                self.core.apply(command)

    def _deliver(self, out: CoreOutputs) -> None:
        puts = []
        for output in out.outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                if output.finished:
                    del self._streams[output.request_id]
                puts.append((stream, output))
        if out.error is not None:  # a step fault: every stream ends with it, never silently
            for request_id in list(self._streams):
                puts.append((self._streams.pop(request_id), EngineDeadError(out.error)))
        positions = self.core.positions()
        if positions is not None:
            for request_id, position in zip(positions.request_ids, positions.positions):
                stream = self._streams.get(request_id)
                if stream is not None and stream.last_position != position:
                    stream.last_position = position
                    puts.append((stream, QueuePosition(position, positions.queue_length)))
        deliver_all(puts)
        for reply in out.replies:
            self._answer(reply)

    def _answer(self, reply: wire.SnapshotReply) -> None:
        future = self._asks.pop(reply.ask_id, None)
        # The asker may be gone (a closed page cancels its wait): then there is no one to
        # answer, and answering a cancelled future would raise here.
        if future is None or not future.set_running_or_notify_cancel():
            return
        if reply.snapshot is not None:
            future.set_result(reply.snapshot)
        else:
            future.set_exception(RuntimeError(reply.error))

