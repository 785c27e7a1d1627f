"""The EngineClient (serving/client.py) of a deployment of engine replicas, held by the
ingress: the model's configs and tokenizer (no weights), requests made and checked here
exactly as an engine makes them, figures as the replicas last posted them (the board), and
submit() streaming a request from whichever replica the router picks; abort() cancels that
call, which aborts the request on its replica. A user's concurrency cap is held here
(UserSlots), so it counts across replicas.
"""
from __future__ import annotations

import asyncio
import collections
import math
from dataclasses import replace

from ray.exceptions import RayError
from ray.serve.exceptions import RequestCancelledError

from pagedllm.core.request import FinishReason, Request, RequestOutput, SamplingParams
from pagedllm.core.output_budget import OutputCaps
from pagedllm.errors import EngineDeadError
from pagedllm.replicas.transport import unpack
from pagedllm.server.errors import APIError
from pagedllm.serving.client import EngineFigures, EngineInfo
from pagedllm.serving.request_front import RequestFront
from pagedllm.structured.spec import GrammarSpec
from pagedllm.tokenizer import Tokenizer


class ReplicaClient:
    def __init__(self, description: dict, num_replicas: int, handle, board):
        """description: one replica's describe() (every replica runs the same settings)."""
        model_config = description["model_config"]
        self.num_replicas = num_replicas
        self.threads_per_replica = description["threads"]
        replica_cache, replica_scheduler = (description["cache_config"],
                                            description["scheduler_config"])
        # The deployment's pool and slots (what admission and the ready line count).
        self.info = EngineInfo(
            model_config, description["model_path"], description["dtype"],
            replace(replica_cache, num_blocks=replica_cache.num_blocks * num_replicas),
            replace(replica_scheduler, max_num_seqs=replica_scheduler.max_num_seqs * num_replicas),
            description["kv_memory_bytes"] * num_replicas, description["cpu"],
            f"{num_replicas} replica(s) x {self.threads_per_replica} compute thread(s) "
            f"(--threads-per-replica)", self.threads_per_replica, description["speculative"])
        self.front = RequestFront(description["model_path"], model_config,
                                  replica_scheduler.max_model_len,
                                  description["speculative"].method == "draft")
        self.posted: list = []  # every live replica's ReplicaFigures (the ingress polls)
        self._handle = handle.options(stream=True)
        self._board = board
        self._streams: dict[str, ReplicaStream] = {}
        self.slots = UserSlots()
        self.dead: str | None = None  # no one replica's death kills the deployment
        self.restarting: str | None = None  # Ray Serve replaces replicas on its own
        self.stalled: str | None = None  # (its health checks are Ray Serve's)
        self.loras = None  # (adapters are not served with --replicas yet)
        self._stopped = asyncio.Event()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.front.tokenizer

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def make_request(self, request_id: str | None, prompt: str | list[int],
                     params: SamplingParams, *, user: str | None = None,
                     cache_salt: str | None = None, caps: OutputCaps | None = None) -> Request:
        return self.front.make_request(request_id, prompt, params, user=user,
                                       cache_salt=cache_salt, caps=caps)

    def compile_grammar(self, spec: GrammarSpec) -> None:
        self.front.compile_grammar(spec)

    def submit(self, request: Request, report_position: bool = False) -> ReplicaStream:
        stream = ReplicaStream(self._handle, self.slots, request, report_position,
                               lambda: self._streams.pop(request.request_id, None))
        self._streams[request.request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort()

    def abort_all(self) -> None:
        for stream in list(self._streams.values()):
            stream.abort()

    def figures(self) -> list[EngineFigures]:
        """Per replica, labelled by its id, for /metrics."""
        return [EngineFigures(f.stats, f.waiting_by_user, f.cache, f.cpu, (f.replica_id,), f.pid,
                              f.node, f.host) for f in self.posted]

    async def snapshot(self, replica: str | None = None):
        """A replica's picture as it last posted it to the board (twice a second; no call
        into the engine), the first one's when none is named."""
        posted = [f for f in self.posted if f.snapshot is not None]
        chosen = [f for f in posted if replica is None or f.replica_id == replica]
        if not chosen:
            if replica is not None and posted:
                raise APIError(404, f"no replica {replica}; these run: "
                                    f"{', '.join(f.replica_id for f in posted)}", "replica",
                               "not_found")
            raise APIError(503, "the replicas have not posted their state yet; retry in a "
                                "second", None, "not_ready", {"Retry-After": "1"})
        return chosen[0].snapshot

    def set_user_policies(self, weights: dict[str, float], max_running: dict[str, int]) -> None:
        """Weights go to every replica (through the board); caps are held here."""
        self.slots.set_caps(max_running)
        self._board.set_weights.remote(dict(weights))

    def run(self) -> None:
        raise RuntimeError("the replicas' engines run in their own processes; the ingress "
                           "serves from Ray Serve's event loop")

    def shutdown(self) -> None:
        self.abort_all()


class UserSlots:
    """Requests each user has dispatched to any replica, held under the user's cap (a key's
    max_concurrent) across the whole deployment. Used on the ingress's event loop only."""

    def __init__(self):
        self._caps: dict[str, int] = {}
        self._dispatched: collections.Counter = collections.Counter()
        self._freed: asyncio.Condition | None = None

    def set_caps(self, caps: dict[str, int]) -> None:
        self._caps = dict(caps)
        self.wake()

    async def take(self, user: str | None, given_up) -> None:
        """Wait until `user` is under its cap (or given_up() says the request was aborted)."""
        if self._freed is None:
            self._freed = asyncio.Condition()
        async with self._freed:
            await self._freed.wait_for(
                lambda: given_up() or self._dispatched[user] < self._caps.get(user, math.inf))
        self._dispatched[user] += 1

    async def give(self, user: str | None) -> None:
        self._dispatched[user] -= 1
        await self._notify()

    def wake(self) -> None:
        """Let waiters look again (caps changed, or one of them was aborted)."""
        if self._freed is not None:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._freed:
            self._freed.notify_all()


class ReplicaStream:
    """One request's outputs from its replica. Leaving the iteration early (a client that
    went away) cancels the call, which aborts the request on the replica; abort() ends it
    with a final output whose finish_reason is "abort", as the local engine does."""

    def __init__(self, handle, slots: UserSlots, request: Request, report_position: bool,
                 forget):
        self._handle, self._slots, self._forget = handle, slots, forget
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
        else:  # perhaps waiting for its user's slot: wake it
            self._slots.wake()

    async def __aiter__(self):
        finished = False
        try:
            await self._slots.take(self.request.user, lambda: self.aborted)
            try:
                async for item in self._replica_outputs():
                    yield item
                    if isinstance(item, RequestOutput) and item.finished:
                        finished = True
                        return
            finally:
                await self._slots.give(self.request.user)
            finished = True
            yield self._abort_output()
        finally:
            self._forget()
            if not finished and self._response is not None:
                self._response.cancel()

    async def _replica_outputs(self):
        """The replica's outputs until the finished one; nothing more once aborted."""
        if self.aborted:
            return
        try:
            self._response = self._handle.generate.remote(self.request, self._report_position)
            async for items in self._response:
                for item in items:
                    if isinstance(item, RequestOutput):
                        item = unpack(item, self._last, self.request.prompt_token_ids)
                        self._last = item
                    yield item
                    if isinstance(item, RequestOutput) and item.finished:
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

    def _abort_output(self) -> RequestOutput:
        last = self._last
        return RequestOutput(
            self.request_id, self.request.prompt_token_ids, last.token_ids if last else [],
            last.text if last else "", [], "", True, FinishReason.ABORT.value,
            num_cached_tokens=last.num_cached_tokens if last else 0,
            logprobs=last.logprobs if last else None)
