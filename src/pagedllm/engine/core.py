"""The engine core: everything an engine is told, and every decision around its steps, in
one place for both transports (vLLM V1's EngineCore).

A transport (the loop thread, engine/async_engine.py; the engine-core process,
serving/core_process.py) moves engine/wire.py messages to `apply`, calls `step` while
`has_work`, and carries what comes back to its requests' streams. The core adds and aborts
requests, sets the users' policies, loads and unloads adapters, answers snapshots, follows
the queue positions its requests asked for, and counts steps failing in a row: past
MAX_CONSECUTIVE_FAULTS it sets `dead` and the transport ends (the server exits; the
engine process's front end restarts it). It runs on its transport's one thread.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pagedllm.core.request import FinishReason, Request, RequestOutput
from pagedllm.engine import wire
from pagedllm.engine.engine import LLMEngine

logger = logging.getLogger("pagedllm.engine_core")
MAX_CONSECUTIVE_FAULTS = 3  # engine steps failing in a row before the engine counts as dead


@dataclass
class CoreOutputs:
    """What the core produced since the transport last took it, in order."""

    outputs: list[RequestOutput] = field(default_factory=list)
    replies: list[wire.SnapshotReply] = field(default_factory=list)
    # A step failed outside any one request: these requests were ended, each with `error`.
    failed: list[str] = field(default_factory=list)
    error: str | None = None


class EngineCore:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.reporting: dict[str, int | None] = {}  # request id -> last position reported
        self.consecutive_faults = 0
        self.dead: str | None = None  # why the engine is unusable, once it is
        self.stopped = False  # told to Stop
        # Called before each step (a model store sets the step's compute threads by what the
        # other models are doing: serving/model_pool.py).
        self.before_step = None
        self._out = CoreOutputs()

    @property
    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests() and not self.stopped

    def take(self) -> CoreOutputs:
        """What was produced since the last take (the transport delivers it)."""
        out, self._out = self._out, CoreOutputs()
        for output in out.outputs:
            if output.finished:
                self.reporting.pop(output.request_id, None)
        for request_id in out.failed:
            self.reporting.pop(request_id, None)
        return out

    # -- commands -----------------------------------------------------------------------------
    def add(self, request: Request, report_position: bool = False) -> None:
        """Add a made request; if the engine refuses it (its adapter was unloaded since it was
        made, its grammar cannot be rebuilt), it ends at once with that error."""
        try:
            self.engine.add(request)
        except Exception as exc:  # noqa: BLE001 - this request fails, the rest go on
            self._out.outputs.append(RequestOutput(
                request.request_id, request.prompt_token_ids, [], "", [], "", True,
                FinishReason.ERROR.value, error=f"{type(exc).__name__}: {exc}"))
            return
        if report_position:
            self.reporting[request.request_id] = None

    def apply(self, message: wire.ToEngine) -> None:
        engine = self.engine
        if isinstance(message, wire.AddRequest):
            try:
                request = message.to_request(engine.scheduler_config.max_model_len,
                                             engine.grammars)
            except Exception as exc:  # noqa: BLE001 - this request fails, the rest go on
                self._out.outputs.append(RequestOutput(
                    message.request_id, message.prompt_token_ids, [], "", [], "", True,
                    FinishReason.ERROR.value, error=f"{type(exc).__name__}: {exc}"))
                return
            self.add(request, message.report_position)
        elif isinstance(message, wire.AbortRequests):
            for request_id in message.request_ids:
                self._abort(request_id)
        elif isinstance(message, wire.AbortAll):
            for request_id in engine.request_ids():
                self._abort(request_id)
        elif isinstance(message, wire.SetUserPolicies):
            engine.set_user_policies(message.weights, message.max_running)
        elif isinstance(message, (wire.LoadAdapter, wire.UnloadAdapter)):
            self._change_adapter(message)
        elif isinstance(message, wire.AskSnapshot):
            try:
                reply = wire.SnapshotReply(message.ask_id, engine.snapshot())
            except Exception as exc:  # noqa: BLE001 - the asker hears it
                reply = wire.SnapshotReply(message.ask_id, None, f"{type(exc).__name__}: {exc}")
            self._out.replies.append(reply)
        elif isinstance(message, wire.Stop):
            self.stopped = True

    def _abort(self, request_id: str) -> None:
        final = self.engine.abort_request(request_id)
        if final is not None:
            self._out.outputs.append(final)

    def _change_adapter(self, message: wire.LoadAdapter | wire.UnloadAdapter) -> None:
        """The front end loaded or unloaded an adapter (after checking it): so does this
        engine. A file that changed in between is logged; its requests then fail alone."""
        loras = self.engine.loras
        try:
            if loras is None:
                raise RuntimeError("this engine serves no adapters")
            if isinstance(message, wire.LoadAdapter):
                loras.load(message.name, message.path)
            else:
                loras.unload(message.name)
        except Exception:  # noqa: BLE001 - the engine goes on; the log says why
            logger.exception("the engine could not apply the adapter change %s", message)

    # -- steps ----------------------------------------------------------------------------------
    def step(self) -> None:
        """One engine step; a failure outside any one request's work (those fail alone, in
        the engine) ends every request with the error, and repeated ones set `dead`."""
        try:
            if self.before_step is not None:
                self.before_step()
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - outside any one request (a scheduler fault)
            self._on_fault(exc)
            return
        self.consecutive_faults = 0
        self._out.outputs += outputs

    def _on_fault(self, exc: Exception) -> None:
        self.consecutive_faults += 1
        logger.exception("engine step failed (%d in a row); failing every request",
                         self.consecutive_faults)
        out = self._out
        out.error = f"engine error: {type(exc).__name__}: {exc}"
        for request_id in self.engine.request_ids():
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 - the request still gets its error
                logger.exception("could not free request %s", request_id)
            out.failed.append(request_id)
        if self.consecutive_faults >= MAX_CONSECUTIVE_FAULTS:
            self.dead = f"{self.consecutive_faults} engine steps failed in a row: {exc}"
            logger.critical("engine unusable: %s", self.dead)

    # -- queue positions --------------------------------------------------------------------
    def positions(self) -> wire.QueuePositions | None:
        """The waiting requests that asked for their position, where it changed."""
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
