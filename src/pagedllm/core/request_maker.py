"""Turning a prompt and sampling parameters into a checked Request, without touching any
engine state: shared by the engine and by a front that only tokenizes (the replicas'
ingress, replicas/front.py), so both refuse the same bad input the same way."""
from __future__ import annotations

import itertools

from pagedllm.core.request import (PromptTooLongError, Request, SamplingParams,
                                   SamplingParamsError, resolve_max_tokens)
from pagedllm.tokenizer import TokenLimitError


class RequestMaker:
    """Needs `tokenizer`, `model_config`, `scheduler_config` and `grammars` on the object."""

    _ids = itertools.count()

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Raises TokenLimitError for a text past the context (not tokenized whole)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode_within(prompt, self.scheduler_config.max_model_len)
        token_ids = list(prompt)
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids
               if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:3]}")
        return token_ids

    def make_request(self, request_id: str | None, prompt: str | list[int],
                     params: SamplingParams | None = None, *, user: str | None = None,
                     cache_salt: str | None = None,
                     max_tokens_limit: int | None = None) -> Request:
        """Validate and build a request without touching engine state (safe from any thread).
        Raises ValueError (an empty or bad prompt), SamplingParamsError (max_tokens over
        max_tokens_limit), PromptTooLongError or GrammarError (a grammar that cannot compile)."""
        params = params or SamplingParams()
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", f"token ids must be in [0, {vocab})")
        max_len = self.scheduler_config.max_model_len
        try:
            prompt_ids = self.tokenize_prompt(prompt)
        except TokenLimitError as exc:
            raise PromptTooLongError(exc.num_tokens, 0, max_len, at_least=True) from exc
        if not prompt_ids:
            raise ValueError("prompt is empty")
        max_tokens = resolve_max_tokens(params.max_tokens, len(prompt_ids), max_len,
                                        max_tokens_limit)
        request = Request(request_id or f"req-{next(self._ids)}", prompt_ids, params,
                          eos_token_ids=self.tokenizer.eos_token_ids, max_model_len=max_len,
                          max_tokens=max_tokens, user=user, cache_salt=cache_salt)
        if params.guided is not None:  # compiled here, on the caller's thread
            request.grammar = self.grammars.matcher(params.guided)
        return request

