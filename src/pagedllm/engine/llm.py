"""The offline API: LLM(model, **settings).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.engine.engine import LLMEngine
from pagedllm.core.request import RequestOutput, SamplingParams
from pagedllm.tokenizer import Tokenizer


class LLM:
    """Offline batch generation: LLM(model=None).generate(prompts, SamplingParams(...))."""

    def __init__(self, model: EngineConfig | str | None = None, **settings):
        """LLM(model, dtype=..., ...): the fields of EngineConfig, or one EngineConfig."""
        self.engine = LLMEngine(model, **settings)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """One finished output per prompt (n per prompt, grouped, when params.n > 1), in order."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        order = []
        for prompt in prompts:
            for _ in range(params.n):
                order.append(self.engine.add_request(None, prompt, params).request_id)
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[rid] for rid in order]
