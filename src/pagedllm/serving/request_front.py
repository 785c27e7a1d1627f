"""The request side of a front end that does not hold the engine (the engine process's
front end, serving/process_client.py; the replicas' ingress, replicas/front.py): the served
model's tokenizer, a grammar compiler and a RequestMaker, built once the same way, so a
request is made and checked there exactly as an engine makes it. Grammars are compiled
there (a bad one is refused before any engine hears of it); each request's matcher is built
where the request runs."""
from __future__ import annotations

from pagedllm.model_config import ModelConfig
from pagedllm.core.request import Request, SamplingParams
from pagedllm.core.output_budget import OutputCaps
from pagedllm.engine.request_maker import RequestMaker
from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.structured.spec import GrammarSpec
from pagedllm.tokenizer import Tokenizer


class RequestFront:
    def __init__(self, model_path: str, model_config: ModelConfig, max_model_len: int,
                 has_draft_model: bool, adapters=None):
        """adapters: the LoRA adapters requests may name (serving/client.py's LoRAAdapters),
        None: none."""
        self.tokenizer = Tokenizer.for_served_model(model_path, model_config.eos_token_ids,
                                                    model_config.bos_token_id)
        self.grammars = GrammarCompiler(self.tokenizer, model_config.vocab_size)
        self.requests = RequestMaker(self.tokenizer, model_config.vocab_size, max_model_len,
                                     self.grammars, build_matchers=False,
                                     has_draft_model=has_draft_model, adapters=adapters)

    def make_request(self, request_id: str | None, prompt: str | list[int],
                     params: SamplingParams, *, user: str | None = None,
                     cache_salt: str | None = None, caps: OutputCaps | None = None) -> Request:
        return self.requests.make_request(request_id, prompt, params, user=user,
                                          cache_salt=cache_salt, caps=caps)

    def compile_grammar(self, spec: GrammarSpec) -> None:
        self.grammars.compile(spec)
