"""The EngineClient (serving/client.py) of an engine in a process of its own (`serve
--engine-process`): the front end half of vLLM V1's split.

Here, in the server's process: tokenizing and checking requests (request_front.py, as the
replicas' ingress does), incremental detokenizing with stop strings (the same
RequestTextState the in-process engine uses, fed the engine's token ids), the streams.
There, in the engine-core process (serving/core_process.py, around engine/core.py):
scheduling and model steps, never waiting on HTTP. Messages: engine/wire.py.

run() reads the engine's outputs on the calling thread (the server's main thread) and
watches the process. When it dies (a kernel's segfault, an OOM kill, steps failing in a
row), every request it held ends with an error saying why, /health and new requests get
503 while it restarts, and a new one is started (engine_keeper.py: at once the first time,
then after a doubling pause while it keeps dying).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections import defaultdict
from dataclasses import dataclass, replace

import torch
import zmq

from pagedllm.config import EngineConfig
from pagedllm.core.output_processor import RequestTextState
from pagedllm.core.request import (FinishReason, QueuePosition, Request, RequestOutput,
                                   SamplingParams)
from pagedllm.core.output_budget import OutputCaps
from pagedllm.core.snapshot import EngineSnapshot, EngineStats
from pagedllm.engine import wire
from pagedllm.engine.streams import RequestStream, StreamQueue, deliver_on
from pagedllm.engine.faults import Faults
from pagedllm.errors import EngineDeadError, EngineUnavailableError
from pagedllm.serving.client import EngineFigures, EngineInfo
from pagedllm.serving.engine_keeper import EngineKeeper, RestartBackoff
from pagedllm.serving.engine_process import EngineProcess
from pagedllm.serving.front_adapters import FrontAdapters
from pagedllm.serving.request_front import RequestFront
from pagedllm.serving.stall_watch import StallWatch
from pagedllm.structured.spec import GrammarSpec
from pagedllm.tokenizer import Tokenizer

POLL_MS = 100  # how often an idle front end looks whether its engine process still runs


@dataclass
class _Front:
    """One request as the front end follows it: the engine's token ids become text here."""

    request: Request
    text: RequestTextState
    stream: StreamQueue


class ProcessEngineClient:
    def __init__(self, config: EngineConfig, faults: Faults | None = None,
                 load_progress=None, backoff: RestartBackoff | None = None,
                 num_threads: int | None = None, stall_watch: StallWatch | None = None):
        """Starts the engine process and waits for its model (ModelLoadError, as in-process,
        when it cannot load). load_progress: see core_process.engine_core_main.
        num_threads: the engine's compute threads (default: this process's torch count).
        stall_watch: when a silent engine counts as stalled, and is restarted."""
        self._stopped = False
        self._stall = stall_watch or StallWatch()
        self._keeper = EngineKeeper(config, faults or Faults(),
                                    num_threads or torch.get_num_threads(), backoff,
                                    load_progress)
        self.info: EngineInfo = self._keeper.wait_first()
        info = self.info
        model = info.model_config
        self.loras = (FrontAdapters(model, config, self._send) if config.lora.active
                      else None)
        self.front = RequestFront(info.model_path, model, info.max_model_len,
                                  info.speculative.method == "draft", self.loras)
        self._fronts: dict[str, _Front] = {}
        # The run() thread follows the engine's tokens in a request's text while the event
        # loop may end it (an abort): one at a time.
        self._text_lock = threading.Lock()
        self._asks: dict[int, concurrent.futures.Future] = {}
        self._ask_ids = itertools.count()
        self._policies: tuple[dict, dict] | None = None
        self._stats = EngineStats(0, 0, 0, info.cache_config.num_blocks, 0.0, 0, 0, 0, 0, 0, 0)
        self._waiting_by_user: dict[str, int] = {}
        self.dead: str | None = None  # never: a dead engine process is restarted

    @property
    def tokenizer(self) -> Tokenizer:
        return self.front.tokenizer

    @property
    def num_in_flight(self) -> int:
        return len(self._fronts)

    @property
    def engine_pid(self) -> int | None:
        engine = self._keeper.engine
        return engine.pid if engine is not None else None

    @property
    def restarting(self) -> str | None:
        """Why requests get 503 now, while the engine process restarts (None: it runs)."""
        return self._keeper.restarting

    @property
    def stalled(self) -> str | None:
        """Why requests get 503 now, while the engine process makes no progress."""
        return self._stall.reason()

    @property
    def restarts(self) -> int:
        return self._keeper.restarts

    # -- the event loop's side --------------------------------------------------------------
    def make_request(self, request_id: str | None, prompt: str | list[int],
                     params: SamplingParams, *, user: str | None = None,
                     cache_salt: str | None = None, caps: OutputCaps | None = None) -> Request:
        return self.front.make_request(request_id, prompt, params, user=user,
                                       cache_salt=cache_salt, caps=caps)

    def compile_grammar(self, spec: GrammarSpec) -> None:
        self.front.compile_grammar(spec)

    def submit(self, request: Request, report_position: bool = False) -> RequestStream:
        stream = StreamQueue.on_running_loop(report_position)
        rid = request.request_id
        self._fronts[rid] = _Front(request, RequestTextState(request, self.front.tokenizer), stream)
        if not self._send(wire.AddRequest.of(request, report_position)):
            del self._fronts[rid]  # (the instant after a crash, before run() has seen it)
            raise EngineUnavailableError(self._unavailable())
        return RequestStream(self.abort, rid, stream)

    def abort(self, request_id: str) -> None:
        """The stream ends here at once (a timeout or a client gone is not held up by a
        busy or stalled engine); the engine drops the request when it hears of it."""
        if request_id in self._fronts:
            self._send(wire.AbortRequests([request_id]))
            self._end_here(request_id)

    def abort_all(self) -> None:
        if not self._send(wire.AbortAll()):
            for request_id in list(self._fronts):
                self._end_here(request_id)

    def figures(self) -> list[EngineFigures]:
        info = self.info
        return [EngineFigures(self._stats, self._waiting_by_user, info.cache_config, info.cpu,
                              device=info.device)]

    async def snapshot(self, replica: str | None = None) -> EngineSnapshot:
        ask_id = next(self._ask_ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._asks[ask_id] = future
        try:
            if not self._send(wire.AskSnapshot(ask_id)):
                raise EngineDeadError(self._unavailable())
            return await asyncio.wait_for(asyncio.wrap_future(future), 30.0)
        finally:
            self._asks.pop(ask_id, None)

    def set_user_policies(self, weights: dict[str, float], max_running: dict[str, int]) -> None:
        self._policies = (dict(weights), dict(max_running))
        self._send(wire.SetUserPolicies(*self._policies))

    def shutdown(self) -> None:
        self._stopped = True

    def _send(self, message) -> bool:
        return self._keeper.send(message)

    def _unavailable(self) -> str:
        return self._keeper.restarting or "the engine process is not running"

    # -- the run() thread -------------------------------------------------------------------
    def run(self) -> None:
        """Read the engine's outputs and keep an engine process running, until shutdown()."""
        try:
            while not self._stopped:
                engine = self._keeper.engine
                if engine is None:
                    self._keeper.restart(lambda: self._stopped, self._brief_new_engine)
                    continue
                if engine.from_engine.poll(POLL_MS):
                    self._take_messages(engine)
                    self._stall.heard()
                elif not engine.process.is_alive():
                    self._take_messages(engine)  # what it sent before it went
                    self._on_engine_exit(engine)
                elif self._stall.check(len(self._fronts)):
                    self._keeper.dead_reason = (
                        f"the engine process (pid {engine.pid}) made no progress for "
                        f"{self._stall.silent_for():.0f} s and was killed")
                    engine.process.kill()
        finally:
            self._keeper.close()
            for request_id in list(self._fronts):
                self._end_here(request_id)

    def _take_messages(self, engine: EngineProcess) -> None:
        while True:
            try:
                raw = engine.from_engine.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            message = wire.from_engine.decode(raw)
            if isinstance(message, wire.StepOutputs):
                self._on_outputs(message)
            elif isinstance(message, wire.SnapshotReply):
                future = self._asks.get(message.ask_id)
                if future is not None and not future.done():
                    if message.snapshot is not None:
                        future.set_result(message.snapshot)
                    else:
                        future.set_exception(RuntimeError(message.error))
            elif isinstance(message, wire.EngineDead):
                self._keeper.dead_reason = message.reason

    def _on_outputs(self, message: wire.StepOutputs) -> None:
        self._stats, self._waiting_by_user = message.stats, message.waiting_by_user
        deliveries: dict = defaultdict(list)
        with self._text_lock:
            for delta in message.deltas:
                front = self._fronts.get(delta.request_id)
                if front is None:  # ended here already (a stop string, an abort)
                    continue
                output = self._apply(front, delta)
                if output.finished:
                    self._fronts.pop(delta.request_id, None)
                deliveries[front.stream.loop].append((front.stream.queue, output))
        positions = message.positions
        if positions is not None:
            for request_id, position in zip(positions.request_ids, positions.positions):
                front = self._fronts.get(request_id)
                if front is not None and front.stream.report_position:
                    item = QueuePosition(position, positions.queue_length)
                    deliveries[front.stream.loop].append((front.stream.queue, item))
        for loop, items in deliveries.items():
            deliver_on(loop, items)

    def _apply(self, front: _Front, delta: wire.TokenDelta) -> RequestOutput:
        """The engine's new tokens as the in-process engine would have given them: text,
        held back where a stop string may begin, ended at a stop string (and the engine is
        told to drop the request)."""
        text = front.text
        try:
            if text.follow(delta.new_token_ids, delta.finish_reason, delta.num_cached_tokens,
                           delta.new_logprobs, delta.queue_time):
                self._send(wire.AbortRequests([front.request.request_id]))
            output = text.make_output()
        except Exception as exc:  # noqa: BLE001 - e.g. detokenizing: this request only
            self._send(wire.AbortRequests([front.request.request_id]))
            return text.last_output(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
        return replace(output, error=delta.error) if delta.error else output

    def _fail(self, request_id: str, why: str) -> None:
        front = self._fronts.pop(request_id, None)
        if front is not None:
            deliver_on(front.stream.loop, [(front.stream.queue, EngineDeadError(why))])

    def _end_here(self, request_id: str) -> None:
        """Aborted: the final output comes from here, whatever the engine is doing."""
        with self._text_lock:
            front = self._fronts.pop(request_id, None)
            if front is None:
                return
            output = front.text.last_output(FinishReason.ABORT)
        deliver_on(front.stream.loop, [(front.stream.queue, output)])

    def _on_engine_exit(self, engine: EngineProcess) -> None:
        reason = self._keeper.on_exit(engine, len(self._fronts))
        self._stall.reset()
        for request_id in list(self._fronts):
            self._fail(request_id, f"{reason}; the server is restarting it: retry the request")
        for future in list(self._asks.values()):
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    def _brief_new_engine(self, engine: EngineProcess) -> None:
        """What a restarted engine must know again: the users' policies, the adapters."""
        self._stall.reset()
        if self._policies is not None:
            engine.send(wire.SetUserPolicies(*self._policies))
        if self.loras is not None:  # those loaded or unloaded since the start
            for message in self.loras.changes_since_start():
                engine.send(message)
