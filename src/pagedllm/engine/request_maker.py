"""Turning a prompt and sampling parameters into a checked Request, without touching any
engine state: the engine has one, and so has a front that only tokenizes (the replicas'
ingress, replicas/front.py), so both refuse the same bad input the same way."""
from __future__ import annotations

import itertools

from pagedllm.core.request import Request, SamplingParams, SamplingParamsError
from pagedllm.core.output_budget import OutputCaps, PromptTooLongError, resolve_max_tokens
from pagedllm.errors import FieldError
from pagedllm.reasoning.gate import request_grammar
from pagedllm.structured.compiler import GrammarCompiler
from pagedllm.tokenizer import TokenLimitError, Tokenizer


class RequestMaker:
    _ids = itertools.count()

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 grammars: GrammarCompiler, build_matchers: bool = True,
                 has_draft_model: bool = False, adapters=None):
        """build_matchers=False: grammars are compiled (so a bad one is refused here) but each
        request's matcher is built where it runs (a replica, the engine process).
        has_draft_model: whether `"speculative": "draft"` can be honoured. adapters: the
        LoRA adapters served (lora/registry.py; anything with get(name)), None: none."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammars = grammars
        self.build_matchers = build_matchers
        self.has_draft_model = has_draft_model
        self.adapters = adapters

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Raises TokenLimitError for a text past the context (not tokenized whole)."""
        if isinstance(prompt, str):
            try:
                return self.tokenizer.encode_within(prompt, self.max_model_len)
            except TokenLimitError:
                raise
            except ValueError as exc:  # not valid Unicode
                raise FieldError("prompt", str(exc)) from exc
        token_ids = list(prompt)
        vocab = self.vocab_size
        bad = [t for t in token_ids
               if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise FieldError("prompt", f"token ids must be integers in [0, {vocab}), got {bad[:3]}")
        return token_ids

    def make_request(self, request_id: str | None, prompt: str | list[int],
                     params: SamplingParams | None = None, *, user: str | None = None,
                     cache_salt: str | None = None, caps: OutputCaps | None = None) -> Request:
        """Validate and build a request without touching engine state (safe from any thread).
        Raises a FieldError naming the field: a bad prompt, SamplingParamsError (max_tokens
        over a cap), PromptTooLongError, GrammarError (a grammar that cannot compile)."""
        params = params or SamplingParams()
        if params.speculative == "draft" and not self.has_draft_model:
            raise SamplingParamsError("speculative", "this server has no draft model "
                                                     "(pagedllm serve --draft-model PATH)")
        if params.lora is not None:
            if self.adapters is None:
                raise FieldError("model", f"this server serves no LoRA adapters, asked for "
                                          f"{params.lora!r} (pagedllm serve --lora NAME=PATH)")
            if self.adapters.get(params.lora) is None:
                raise FieldError("model", f"no LoRA adapter named {params.lora!r} is loaded")
        vocab = self.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", f"token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias):
            raise SamplingParamsError("logit_bias", f"token ids must be in [0, {vocab})")
        caps = caps or OutputCaps(self.max_model_len)
        try:
            prompt_ids = self.tokenize_prompt(prompt)
        except TokenLimitError as exc:
            raise PromptTooLongError(exc.num_tokens, 0, caps.max_model_len, at_least=True) from exc
        if not prompt_ids:
            raise FieldError("prompt", "must not be empty")
        max_tokens = resolve_max_tokens(params.max_tokens, len(prompt_ids), caps)
        request = Request(request_id or f"req-{next(self._ids)}", prompt_ids, params,
                          eos_token_ids=self.tokenizer.eos_token_ids,
                          max_model_len=caps.max_model_len, max_tokens=max_tokens, user=user,
                          cache_salt=cache_salt)
        # compiled here, on the caller's thread (a bad grammar is refused before it queues)
        grammar = request_grammar(params, self.grammars, request.eos_token_ids)
        request.grammar = grammar if self.build_matchers else None
        return request
