"""What the usual FastAPI app (server/app.py) sees in the ingress instead of an engine.

EngineFront stands for the whole deployment: the model's configs and tokenizer (no weights),
requests made and checked here exactly as the engine makes them, and figures summed over the
replicas (from the board). ReplicaAsyncEngine stands for the loop thread: submit() streams a
request from whichever replica the router picks; abort() cancels that call, which aborts the
request on its replica. A user's concurrency cap is held here, so it counts across replicas.
"""
from __future__ import annotations

import asyncio
import collections
import math
import os
from dataclasses import replace

from ray.exceptions import RayError
from ray.serve.exceptions import RequestCancelledError

from pagedllm.core.async_engine import EngineDeadError
from pagedllm.core.engine import EngineStats
from pagedllm.core.request import FinishReason, Request, RequestOutput
from pagedllm.core.request_maker import RequestMaker
from pagedllm.replicas.transport import unpack
from pagedllm.server.errors import APIError
from pagedllm.server.metrics import EngineFigures
from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.tokenizer import Tokenizer


class EngineFront(RequestMaker):
    def __init__(self, description: dict, num_replicas: int):
        self.model_config = description["model_config"]
        self.model_path = description["model_path"]
        self.dtype = description["dtype"]
        self.cpu = description["cpu"]
        self.threads_per_replica = description["threads"]
        self.num_replicas = num_replicas
        self.tokenizer = _tokenizer(self.model_path, self.model_config)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        # One replica's pool and slots, and the deployment's (what admission and the ready
        # line count): every replica runs the same engine settings.
        self.replica_cache_config = description["cache_config"]
        self.replica_scheduler_config = description["scheduler_config"]
        self.cache_config = replace(self.replica_cache_config,
                                    num_blocks=self.replica_cache_config.num_blocks * num_replicas)
        self.scheduler_config = replace(
            self.replica_scheduler_config,
            max_num_seqs=self.replica_scheduler_config.max_num_seqs * num_replicas)
        self.kv_memory_bytes = description["kv_memory_bytes"] * num_replicas
        self.figures: list = []  # every live replica's ReplicaFigures (the ingress polls)

    @property
    def capacity_tokens(self) -> int:
        return self.cache_config.num_blocks * self.cache_config.block_size

    def make_request(self, *args, **kwargs) -> Request:
        request = super().make_request(*args, **kwargs)
        request.grammar = None  # compiled (so a bad grammar is refused here); rebuilt there
        return request

    def replica_figures(self) -> list[EngineFigures]:
        """Per replica, labelled by its id, for /metrics."""
        return [EngineFigures(f.stats, f.waiting_by_user, f.cache, f.cpu, (f.replica_id,), f.pid)
                for f in self.figures]

    def stats(self) -> EngineStats:
        rows = [f.stats for f in self.figures]
        total = sum(r.kv_blocks_total for r in rows)
        used = sum(r.kv_blocks_used for r in rows)
        summed = {name: sum(getattr(r, name) for r in rows) for name in (
            "num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits",
            "num_preemptions", "num_prompt_tokens", "num_generation_tokens", "last_step_tokens")}
        return EngineStats(kv_blocks_used=used, kv_blocks_total=total,
                           kv_usage=used / total if total else 0.0,
                           memory_pressure=any(r.memory_pressure for r in rows), **summed)

    def waiting_by_user(self) -> dict[str, int]:
        waiting: collections.Counter = collections.Counter()
        for f in self.figures:
            waiting.update(f.waiting_by_user)
        return dict(waiting)


def _tokenizer(path: str, model_config) -> Tokenizer:
    if os.path.isdir(path):
        return Tokenizer.from_folder(path, model_config.eos_token_ids, model_config.bos_token_id)
    return Tokenizer.from_model_path(path)


class ReplicaAsyncEngine:
    """AsyncEngine's surface for the app, over the engine deployment's handle."""

    def __init__(self, handle, board):
        self._handle = handle.options(stream=True)
        self._board = board
        self._streams: dict[str, ReplicaStream] = {}
        self._caps: dict[str, int] = {}  # user -> requests at once, across every replica
        self._dispatched: collections.Counter = collections.Counter()
        self._slot_freed: asyncio.Condition | None = None
        self.dead: str | None = None  # no one replica's death kills the deployment

    def submit(self, request: Request, report_position: bool = False) -> ReplicaStream:
        stream = ReplicaStream(self, request, report_position)
        self._streams[request.request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort()

    def abort_all(self) -> None:
        for stream in list(self._streams.values()):
            stream.abort()

    async def snapshot(self, timeout: float = 30.0):
        raise APIError(501, "the live view shows one engine; with --replicas each replica has "
                            "its own KV pool: watch /metrics, labelled by replica", None,
                       "unsupported")

    def set_user_policies(self, weights: dict[str, float], max_running: dict[str, int]) -> None:
        """Weights go to every replica (through the board); caps are held here."""
        self._caps = dict(max_running)
        self._board.set_weights.remote(dict(weights))
        if self._slot_freed is not None:
            asyncio.get_running_loop().create_task(self._notify())

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 5.0) -> None:
        self.abort_all()

    # -- a user's share of the whole deployment -------------------------------------------
    async def _take_slot(self, stream: ReplicaStream) -> None:
        user = stream.request.user
        if self._slot_freed is None:
            self._slot_freed = asyncio.Condition()
        async with self._slot_freed:
            await self._slot_freed.wait_for(
                lambda: stream.aborted or self._dispatched[user] < self._caps.get(user, math.inf))
        self._dispatched[user] += 1

    async def _give_slot(self, user: str | None) -> None:
        self._dispatched[user] -= 1
        await self._notify()

    async def _notify(self) -> None:
        async with self._slot_freed:
            self._slot_freed.notify_all()

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)


class ReplicaStream:
    """One request's outputs from its replica. Leaving the iteration early (a client that
    went away) cancels the call, which aborts the request on the replica; abort() ends it
    with a final output whose finish_reason is "abort", as the local engine does."""

    def __init__(self, engine: ReplicaAsyncEngine, request: Request, report_position: bool):
        self._engine = engine
        self.request = request
        self.request_id = request.request_id
        self._report_position = report_position
        self._response = None
        self._last: RequestOutput | None = None
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True
        if self._response is not None:
            self._response.cancel()
        elif self._engine._slot_freed is not None:  # waiting for its user's slot: wake it
            asyncio.get_running_loop().create_task(self._engine._notify())

    async def __aiter__(self):
        engine, finished = self._engine, False
        try:
            await engine._take_slot(self)
            try:
                if not self.aborted:
                    self._response = engine._handle.generate.remote(self.request,
                                                                    self._report_position)
                    async for items in self._response:
                        for item in items:
                            if isinstance(item, RequestOutput):
                                item = unpack(item, self._last, self.request.prompt_token_ids)
                                self._last = item
                                finished = item.finished
                            yield item
                            if finished:
                                return
                    if not self.aborted:
                        raise EngineDeadError("the replica ended this request's stream early")
            except (RequestCancelledError, asyncio.CancelledError):
                if not self.aborted:
                    raise
            except RayError as exc:
                raise EngineDeadError(f"the replica serving this request stopped "
                                      f"({type(exc).__name__}); the other replicas go on "
                                      f"serving") from exc
            finally:
                await engine._give_slot(self.request.user)
            finished = True
            yield self._abort_output()
        finally:
            engine._forget(self.request_id)
            if not finished and self._response is not None:
                self._response.cancel()

    def _abort_output(self) -> RequestOutput:
        last = self._last
        return RequestOutput(
            self.request_id, self.request.prompt_token_ids, last.token_ids if last else [],
            last.text if last else "", [], "", True, FinishReason.ABORT.value,
            num_cached_tokens=last.num_cached_tokens if last else 0,
            logprobs=last.logprobs if last else None)
