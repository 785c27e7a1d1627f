"""The EngineClient of one engine in this process: the engine's loop (engine/async_engine.py)
stepped on the thread that calls run() (the server's main thread), or on a thread of its
own. What the HTTP side reads of the engine is what it published after its last step."""
from __future__ import annotations

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.request import Request, SamplingParams
from pagedllm.core.output_budget import OutputCaps
from pagedllm.core.snapshot import EngineSnapshot
from pagedllm.engine.async_engine import AsyncEngine, RequestStream
from pagedllm.engine.engine import LLMEngine
from pagedllm.engine.faults import Faults
from pagedllm.serving.client import EngineFigures, EngineInfo
from pagedllm.structured.spec import GrammarSpec


class LocalEngineClient:
    restarting = None  # an engine in this process is never restarted
    stalled = None  # (a step that hangs holds this thread: nothing here would notice)

    def __init__(self, engine: LLMEngine, start_thread: bool = False):
        """start_thread=False: the caller runs the loop with run() (the server's main
        thread, where torch's CPU kernels run fastest: BENCHMARKS.md)."""
        self.engine = engine
        # The LoRA adapters served (lora/registry.py; loaded and unloaded from the HTTP
        # thread), None without slots.
        self.loras = engine.loras
        self.loop = AsyncEngine(engine, start_thread=start_thread)
        self.info = engine_info(engine)

    @classmethod
    def load(cls, config: EngineConfig, load_progress=None, faults: Faults | None = None,
             start_thread: bool = False) -> LocalEngineClient:
        return cls(LLMEngine(config, load_progress=load_progress, faults=faults), start_thread)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def dead(self) -> str | None:
        return self.loop.dead

    @property
    def num_in_flight(self) -> int:
        return self.loop.num_in_flight

    def make_request(self, request_id: str | None, prompt: str | list[int],
                     params: SamplingParams, *, user: str | None = None,
                     cache_salt: str | None = None, caps: OutputCaps | None = None) -> Request:
        return self.engine.make_request(request_id, prompt, params, user=user,
                                        cache_salt=cache_salt, caps=caps)

    def compile_grammar(self, spec: GrammarSpec) -> None:
        self.engine.grammars.compile(spec)

    def submit(self, request: Request, report_position: bool = False) -> RequestStream:
        return self.loop.submit(request, report_position)

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id)

    def abort_all(self) -> None:
        self.loop.abort_all()

    def figures(self) -> list[EngineFigures]:
        engine = self.engine
        return [EngineFigures(engine.stats(), engine.waiting_by_user(), engine.cache_config,
                              engine.cpu, device=engine.backend.device)]

    async def snapshot(self, replica: str | None = None) -> EngineSnapshot:
        return await self.loop.snapshot()  # one engine: `replica` names nothing here

    def set_user_policies(self, weights: dict[str, float], max_running: dict[str, int]) -> None:
        self.loop.set_user_policies(weights, max_running)

    def run(self) -> None:
        self.loop.run_loop()

    def shutdown(self) -> None:
        self.loop.shutdown()


def engine_info(engine: LLMEngine, compute: str | None = None, num_threads: int | None = None
                ) -> EngineInfo:
    threads = torch.get_num_threads() if num_threads is None else num_threads
    return EngineInfo(engine.model_config, engine.model_path, engine.dtype, engine.cache_config,
                      engine.scheduler_config, engine.kv_memory_bytes, engine.cpu,
                      compute or f"{threads} compute thread(s) (--threads)", threads,
                      engine.speculator.config, engine.backend.device,
                      gpu_name(engine.backend.device))


def gpu_name(device: str) -> str:
    """The card an engine on `device` runs on, as "NAME, N GiB" ("" for the CPU)."""
    if device != "cuda":
        return ""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
