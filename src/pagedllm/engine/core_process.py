"""The engine-core process's loop: schedule -> execute -> update, busy-looping while there is
work, never waiting on HTTP (vLLM V1's EngineCore, SGLang's scheduler process).

Its front end (serving/process_client.py) starts the process (serving/engine_process.py),
sends it requests as token ids and reads each step's new token ids back (engine/wire.py).
Between steps it takes every message waiting without blocking; with nothing to run it
blocks on its socket (and notices a front end that went away, so it never outlives the
server).
"""
from __future__ import annotations

import logging
import os

import zmq

from pagedllm.core.request import FinishReason, Request, RequestOutput
from pagedllm.engine import wire
from pagedllm.engine.engine import LLMEngine

logger = logging.getLogger("pagedllm.engine_core")
MAX_CONSECUTIVE_FAULTS = 3  # as the in-process loop (engine/async_engine.py)
IDLE_POLL_MS = 500  # how often an idle engine looks whether its front end is still there
EXIT_GAVE_UP = 70  # steps failed in a row: the front end restarts it


class EngineCore:
    def __init__(self, engine: LLMEngine, inbox, outbox, parent_pid: int):
        self.engine = engine
        self.inbox, self.outbox = inbox, outbox
        self.parent_pid = parent_pid
        self.reporting: dict[str, int | None] = {}  # request id -> last position sent
        self.consecutive_faults = 0
        self.stopped = False

    def run(self) -> int:
        """Until Stop (0), the front end's exit (0), or steps failing in a row (70)."""
        engine = self.engine
        while not self.stopped:
            deltas: list[wire.TokenDelta] = []
            if not engine.has_unfinished_requests():
                if not self.inbox.poll(IDLE_POLL_MS):
                    if os.getppid() != self.parent_pid:
                        logger.warning("the front end is gone: the engine process ends")
                        return 0
                    continue
            elif os.getppid() != self.parent_pid:  # busy, but nobody to answer any more
                logger.warning("the front end is gone: the engine process ends")
                return 0
            self._take_messages(deltas)
            if engine.has_unfinished_requests() and not self.stopped:
                try:
                    outputs = engine.step()
                except Exception as exc:  # noqa: BLE001 - outside any one request
                    if self._on_fault(exc, deltas):
                        return EXIT_GAVE_UP
                else:
                    self.consecutive_faults = 0
                    deltas += [_delta(output) for output in outputs]
            self._send(deltas)
        return 0

    def _take_messages(self, deltas: list) -> None:
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._apply(wire.to_engine.decode(raw), deltas)

    def _apply(self, message, deltas: list) -> None:
        engine = self.engine
        if isinstance(message, wire.AddRequest):
            request = Request(message.request_id, message.prompt_token_ids, message.params,
                              eos_token_ids=tuple(message.eos_token_ids),
                              max_model_len=engine.scheduler_config.max_model_len,
                              max_tokens=message.max_tokens, user=message.user,
                              cache_salt=message.cache_salt, arrival_time=message.arrival_time)
            try:
                if request.params.guided is not None:  # matchers do not travel
                    request.grammar = engine.grammars.matcher(request.params.guided)
                engine.add(request)
            except Exception as exc:  # noqa: BLE001 - this request fails, the rest go on
                deltas.append(wire.TokenDelta(request.request_id, [], FinishReason.ERROR.value,
                                              error=f"{type(exc).__name__}: {exc}"))
                return
            if message.report_position:
                self.reporting[request.request_id] = None
        elif isinstance(message, wire.AbortRequests):
            for request_id in message.request_ids:
                self._abort(request_id, deltas)
        elif isinstance(message, wire.AbortAll):
            for request_id in engine.request_ids():
                self._abort(request_id, deltas)
        elif isinstance(message, wire.SetUserPolicies):
            engine.set_user_policies(message.weights, message.max_running)
        elif isinstance(message, (wire.LoadAdapter, wire.UnloadAdapter)):
            self._change_adapter(message)
        elif isinstance(message, wire.AskSnapshot):
            try:
                reply = wire.SnapshotReply(message.ask_id, engine.snapshot())
            except Exception as exc:  # noqa: BLE001 - the asker hears it
                reply = wire.SnapshotReply(message.ask_id, None, f"{type(exc).__name__}: {exc}")
            self.outbox.send(wire.encoder.encode(reply))
        elif isinstance(message, wire.Stop):
            self.stopped = True

    def _change_adapter(self, message) -> None:
        """The front end loaded or unloaded an adapter (after checking it): so does this
        engine. A file that changed in between is logged; its requests then fail alone."""
        loras = self.engine.loras
        try:
            if isinstance(message, wire.LoadAdapter):
                loras.load(message.name, message.path)
            else:
                loras.unload(message.name)
        except Exception:  # noqa: BLE001 - the engine goes on; the log says why
            logger.exception("the engine process could not apply the adapter change %s", message)

    def _abort(self, request_id: str, deltas: list) -> None:
        final = self.engine.abort_request(request_id)
        if final is not None:
            deltas.append(_delta(final))

    def _positions(self) -> wire.QueuePositions | None:
        """The waiting requests that asked, where their position changed."""
        if not self.reporting:
            return None
        order = self.engine.queue_positions()
        changed_ids, changed = [], []
        for position, request_id in enumerate(order, 1):
            if request_id in self.reporting and self.reporting[request_id] != position:
                self.reporting[request_id] = position
                changed_ids.append(request_id)
                changed.append(position)
        return wire.QueuePositions(changed_ids, changed, len(order)) if changed else None

    def _send(self, deltas: list) -> None:
        for delta in deltas:
            if delta.finish_reason is not None:
                self.reporting.pop(delta.request_id, None)
        positions = self._positions()
        if not deltas and positions is None:
            return
        engine = self.engine
        self.outbox.send(wire.encoder.encode(wire.StepOutputs(
            deltas, positions, engine.stats(), engine.waiting_by_user())))

    def _on_fault(self, exc: Exception, deltas: list) -> bool:
        """Every request ends with the error; True once steps failed too often in a row
        (the front end is told why, and restarts this process)."""
        self.consecutive_faults += 1
        logger.exception("engine step failed (%d in a row); failing every request",
                         self.consecutive_faults)
        error = f"engine error: {type(exc).__name__}: {exc}"
        for request_id in self.engine.request_ids():
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - the request still gets its error below
                logger.exception("could not free request %s", request_id)
            deltas.append(wire.TokenDelta(request_id, [], FinishReason.ERROR.value, error=error))
        if self.consecutive_faults < MAX_CONSECUTIVE_FAULTS:
            return False
        self._send(deltas)
        reason = f"{self.consecutive_faults} engine steps failed in a row: {exc}"
        self.outbox.send(wire.encoder.encode(wire.EngineDead(reason)))
        return True


def _delta(output: RequestOutput) -> wire.TokenDelta:
    return wire.TokenDelta(output.request_id, output.new_token_ids, output.finish_reason,
                           output.num_cached_tokens, output.new_logprobs, output.queue_time,
                           output.error)
