"""EngineClient: the one interface the HTTP server has to whatever generates tokens.

The local engine (serving/local.py), the engine in its own process (serving/process_client.py),
the Ray replicas' front (replicas/front.py) and the model store's pool (serving/model_pool.py)
implement it; the server (server/) imports this module and nothing of
the engine's own. The contract:

- `info` and `tokenizer` say what is served; they never change while serving (a model
  store's pool, serving/model_pool.py, has none of its own: each loaded model's client has).
- `make_request` turns a prompt and sampling parameters into a checked Request without
  touching any engine state (safe on the event loop). It raises a FieldError (errors.py)
  naming the field for bad input; the output budget is decided there, once
  (core/output_budget.py resolve_max_tokens, from the OutputCaps given).
- `compile_grammar` compiles a request's grammar into the shared cache; slow, so the
  server calls it on a worker thread.
- `submit` queues a made request and returns its stream: an async iterable of
  RequestOutput deltas (and QueuePosition records when asked), ending with the finished
  output; leaving it early aborts the request. `abort`/`abort_all` end requests with
  finish_reason "abort".
- `figures()` returns what the engines last published (plain records): the HTTP thread
  never calls into an engine's state. `snapshot()` asks the engine thread for a full
  picture between steps (the live view), when one engine can give it.
- `run()` blocks the calling thread until `shutdown()`: the local engine steps there (torch
  runs faster on the main thread); the engine process's front end reads its outputs and
  restarts it there (serving/process_client.py); a front for remote engines just waits.
- `dead` says why the engines are unusable for good (the server exits); `restarting` why
  they are not taking requests for now (503 with Retry-After meanwhile); `stalled` why an
  engine with requests in flight has made no progress for a while (serving/stall_watch.py;
  503 too).
- `loras` lists, finds, loads and unloads the LoRA adapters served over the model and
  resolves a request's model name to one (LoRAAdapters below); None where none are served
  (no slots, the replicas, a model store's pool: its models' clients have their own). An
  engine in another process follows its front end's loads and unloads
  (serving/front_adapters.py).
"""
from __future__ import annotations

from collections.abc import AsyncIterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pagedllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedllm.model_config import ModelConfig
from pagedllm.core.request import QueuePosition, Request, RequestOutput, SamplingParams
from pagedllm.core.output_budget import OutputCaps
from pagedllm.core.snapshot import EngineSnapshot, EngineStats
from pagedllm.kernels.cpu import Capabilities
from pagedllm.structured.spec import GrammarSpec

if TYPE_CHECKING:  # torch stays out of the server's imports until an engine needs it
    from pagedllm.lora.adapter import LoRAAdapter


@dataclass(frozen=True)
class EngineInfo:
    """What is served and how, as the ready line, /v1/models, /api/ps and the page say it."""

    model_config: ModelConfig
    model_path: str
    dtype: str
    cache_config: CacheConfig  # all engines together (a replica's times the replicas)
    scheduler_config: SchedulerConfig  # max_num_seqs: all engines together
    kv_memory_bytes: int
    cpu: Capabilities
    compute: str  # the compute threads, in words ("2 compute thread(s) (--threads)")
    num_threads: int
    speculative: SpeculativeConfig = SpeculativeConfig()
    device: str = "cpu"  # where the model runs (--device)
    device_name: str = ""  # the GPU as its driver names it, with its memory ("" on a CPU)

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    @property
    def capacity_tokens(self) -> int:
        return self.cache_config.num_blocks * self.cache_config.block_size


@dataclass(frozen=True)
class EngineFigures:
    """One engine's published figures for a scrape; `labels` tell engines apart (a replica's
    id). Plain data, replaced whole by the engine, read by any thread."""

    stats: EngineStats
    waiting_by_user: dict
    cache: CacheConfig
    cpu: Capabilities
    labels: tuple[str, ...] = ()
    pid: int | None = None  # a replica's process (replica_info), None for this process
    node: str = ""  # a replica's Ray node and host (replica_info)
    host: str = ""
    device: str = "cpu"  # where the engine's model runs (device_info)
    model: str = ""  # a model store's name for the engine's model ("": the served model)


RequestStream = AsyncIterable[RequestOutput | QueuePosition]


class LoRAAdapters(Protocol):
    """The LoRA adapters served over one model (lora/registry.py's LoRARegistry); safe from
    any thread."""

    def adapters(self) -> list[LoRAAdapter]:
        """In the order they were loaded."""
        ...

    def get(self, name: str) -> LoRAAdapter | None: ...

    def named(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (Ollama's `NAME:latest` too), or None."""
        ...

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read, check and serve it; AdapterError (one line) when it cannot be."""
        ...

    def unload(self, name: str) -> LoRAAdapter:
        """KeyError for a name not loaded; its running requests finish with it."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    info: EngineInfo
    dead: str | None  # why the engines are unusable, once they are
    restarting: str | None  # why no request is taken now, while an engine restarts
    stalled: str | None  # why no request is taken now, while an engine makes no progress
    loras: LoRAAdapters | None  # the LoRA adapters served over the model; None: none

    @property
    def tokenizer(self): ...

    @property
    def num_in_flight(self) -> int: ...

    def make_request(self, request_id: str | None, prompt: str | list[int],
                     params: SamplingParams, *, user: str | None = None,
                     cache_salt: str | None = None,
                     caps: OutputCaps | None = None) -> Request: ...

    def compile_grammar(self, spec: GrammarSpec) -> None: ...

    def submit(self, request: Request, report_position: bool = False) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> None: ...

    def figures(self) -> list[EngineFigures]: ...

    async def snapshot(self, replica: str | None = None) -> EngineSnapshot:
        """The engine's picture (blocks, requests, fair share); with replicas, the named
        one's (figures() labels them), as it last published it."""
        ...

    def set_user_policies(self, weights: dict[str, float], max_running: dict[str, int]) -> None: ...

    def run(self) -> None: ...

    def shutdown(self) -> None: ...
