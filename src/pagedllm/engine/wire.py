"""The messages an engine core (engine/core.py) takes and gives: between the front end and
the engine-core process (serving/process_client.py, serving/core_process.py) as msgpack over
ZMQ, and to the loop thread's core as they are (engine/async_engine.py).

Text never crosses: requests go in as token ids with their sampling parameters, and each
step comes out as token ids, finish reasons and the engine's published figures. The front
end tokenizes, detokenizes and finds stop strings itself. Each message is one msgpack
array whose first element is its kind's tag (msgspec's tagged structs), decoded into the
plain dataclasses the rest of the code already uses (SamplingParams, EngineStats,
EngineSnapshot, TokenLogprob): nothing is pickled off the socket.
"""
from __future__ import annotations

import msgspec

from pagedllm.core.request import Request, SamplingParams, TokenLogprob
from pagedllm.reasoning.gate import request_grammar
from pagedllm.core.snapshot import EngineSnapshot, EngineStats


class _Message(msgspec.Struct, array_like=True, tag=True):
    pass


# -- front end -> engine ----------------------------------------------------------------
class AddRequest(_Message, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    max_tokens: int | None
    user: str | None
    cache_salt: str | None
    arrival_time: float  # time.monotonic(): one clock for every process on the machine
    report_position: bool

    @classmethod
    def of(cls, request: Request, report_position: bool) -> AddRequest:
        return cls(request.request_id, request.prompt_token_ids, request.params,
                   list(request.eos_token_ids), request.max_tokens, request.user,
                   request.cache_salt, request.arrival_time, report_position)

    def to_request(self, max_model_len: int, grammars) -> Request:
        """The Request again, on the engine's side; its grammar's matcher (matchers do not
        travel) from the engine's compiler (structured/compiler.py)."""
        request = Request(self.request_id, self.prompt_token_ids, self.params,
                          eos_token_ids=tuple(self.eos_token_ids), max_model_len=max_model_len,
                          max_tokens=self.max_tokens, user=self.user, cache_salt=self.cache_salt,
                          arrival_time=self.arrival_time)
        request.grammar = request_grammar(self.params, grammars, request.eos_token_ids)
        return request


class AbortRequests(_Message, tag="abort"):
    request_ids: list[str]


class AbortAll(_Message, tag="abort_all"):
    pass


class SetUserPolicies(_Message, tag="policies"):
    weights: dict[str, float]
    max_running: dict[str, int]


class LoadAdapter(_Message, tag="load_adapter"):
    """A LoRA adapter the front end has read and checked; the engine reads it too."""
    name: str
    path: str


class UnloadAdapter(_Message, tag="unload_adapter"):
    name: str


class AskSnapshot(_Message, tag="ask_snapshot"):
    ask_id: int


class Stop(_Message, tag="stop"):
    pass


ToEngine = (AddRequest | AbortRequests | AbortAll | SetUserPolicies | LoadAdapter | UnloadAdapter
            | AskSnapshot | Stop)


# -- engine -> front end ----------------------------------------------------------------
class TokenDelta(msgspec.Struct, array_like=True):
    """One request's new tokens since its last delta; finish_reason once it ended."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprob] | None = None
    queue_time: float | None = None
    error: str | None = None


class QueuePositions(msgspec.Struct, array_like=True):
    request_ids: list[str]  # waiting requests that asked, each with its changed position
    positions: list[int]
    queue_length: int


class StepOutputs(_Message, tag="outputs"):
    deltas: list[TokenDelta]
    positions: QueuePositions | None
    stats: EngineStats
    waiting_by_user: dict[str, int]


class SnapshotReply(_Message, tag="snapshot"):
    ask_id: int
    snapshot: EngineSnapshot | None
    error: str | None = None


class EngineDead(_Message, tag="dead"):
    """The engine gave up (steps failing in a row); the process exits after sending it."""

    reason: str


FromEngine = StepOutputs | SnapshotReply | EngineDead

encoder = msgspec.msgpack.Encoder()
to_engine = msgspec.msgpack.Decoder(ToEngine)
from_engine = msgspec.msgpack.Decoder(FromEngine)
