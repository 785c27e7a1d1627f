"""A request's output budget, decided once before the request is made: everything that
bounds it (OutputCaps) and the one function that decides and checks it."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.request import SamplingParamsError
from pagedllm.errors import FieldError


class PromptTooLongError(FieldError):
    """prompt + max_tokens does not fit the context; both numbers are in the message."""

    code = "context_length_exceeded"

    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int,
                 at_least: bool = False, param: str = "max_tokens"):
        """at_least: num_prompt_tokens is a lower bound (the text was not tokenized)."""
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        has = f"at least {num_prompt_tokens} prompt tokens" if at_least else \
            f"{num_prompt_tokens} prompt tokens and asks for {max_tokens} more " \
            f"({num_prompt_tokens + max_tokens} in all)"
        super().__init__(param, f"this model's maximum context length is {max_model_len} "
                                f"tokens, but the request has {has}")


@dataclass(frozen=True)
class OutputCaps:
    """Everything that bounds one request's output, gathered before it is made: the served
    context, the server's --max-tokens-limit, the client's own context window (Ollama's
    num_ctx: the answer ends there) and what its API key has left this minute."""

    max_model_len: int
    server_limit: int | None = None
    context: int | None = None
    context_param: str = "options.num_ctx"
    key_budget: int | None = None  # tokens (prompt + output) the key may still use now


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, caps: OutputCaps) -> int:
    """The one place a request's output budget is decided and checked. None means "up to the
    context length" (and up to the server's cap and the key's budget, where set); an explicit
    value over the server's cap or past the context is an error, never silently cut. A
    client context window (num_ctx) cuts either, as Ollama does."""
    limit = caps.server_limit
    if requested is not None and limit is not None and requested > limit:
        raise SamplingParamsError("max_tokens", f"{requested} is over this server's limit of "
                                                f"{limit}")
    max_len = caps.max_model_len
    if caps.context is not None:
        if caps.context > max_len:
            raise FieldError(caps.context_param, f"{caps.context} is over this server's context "
                                                 f"of {max_len} tokens")
        room = caps.context - num_prompt_tokens
        if room < 1:
            raise FieldError(caps.context_param, f"the prompt has {num_prompt_tokens} tokens; "
                                                 f"a context of {caps.context} leaves no room "
                                                 f"for an answer")
        requested = room if requested is None else min(requested, room)
    if requested is None:
        requested = max(1, max_len - num_prompt_tokens)
        if limit is not None:
            requested = min(requested, limit)
        if caps.key_budget is not None:  # never below 1: the key's check refuses it then
            requested = min(requested, max(1, caps.key_budget - num_prompt_tokens))
    if num_prompt_tokens + requested > max_len:
        raise PromptTooLongError(num_prompt_tokens, requested, max_len)
    return requested
