"""Pydantic schemas of the OpenAI API subset pagedllm serves, and their mapping to
SamplingParams. Validation errors become 400s that name the field."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, StringConstraints, field_validator

from pagedllm.config import CHAT_DEFAULT_MAX_TOKENS, COMPLETIONS_DEFAULT_MAX_TOKENS
from pagedllm.core.request import (LOGIT_BIAS_RANGE, MAX_INT32, MAX_LOGIT_BIAS_TOKENS,
                                   MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                   MIN_REPETITION_PENALTY, SEED_RANGE, SamplingParams,
                                   SamplingParamsError)
from pagedllm.errors import FieldError
from pagedllm.structured.spec import GrammarSpec, spec_from_request
from pagedllm.server.chat_protocol import ChatMessage, ChatTemplateFields
from pagedllm.server.request_model import RequestModel


def random_id(prefix: str, separator: str = "-") -> str:
    """An id the way the API it belongs to spells them (clients check the prefix): OpenAI's
    chat and completion ids with "-" (chatcmpl-...), the Responses API's and Anthropic's
    with "_" (resp_..., msg_...)."""
    return f"{prefix}{separator}{uuid.uuid4().hex}"


# The bounds SamplingParams holds every request to (core/request.py), published in the schema.
StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_INT32)]


class StreamOptions(RequestModel):
    include_usage: bool = False


Bias = Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]


class LoraChoice(RequestModel):
    """llama.cpp's per-request adapter: its id in GET /lora-adapters and its scale."""

    id: int = Field(ge=0)
    scale: float = Field(default=1.0, ge=-10.0, le=10.0, allow_inf_nan=False)


class SamplingFields(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions. Every field is honoured
    or listed as having no effect on the answer (docs/apis.md's field table, held by a test); any
    other field is refused with a 400 naming it, never silently ignored (as OpenAI does)."""

    model: str | None = None
    max_tokens: int | None = Field(default=CHAT_DEFAULT_MAX_TOKENS, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, ge=MIN_REPETITION_PENALTY, le=2.0)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    n: int = Field(default=1, ge=1, le=16)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extension: while a streaming request waits, send chunks with its queue position.
    queue_position: bool = False
    # Extension: speculative decoding for this request ("off", "ngram"); the server's
    # --speculative otherwise. Same output either way, only the speed differs.
    speculative: Literal["off", "ngram", "draft"] | None = None
    # Structured output: OpenAI's response_format, or one of vLLM's guided_* fields.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # llama.cpp's names for the same: a GBNF (or Lark) grammar, a JSON schema.
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    # OpenAI's: token id (as a string) -> bias added to its logit; -100 bans, 100 forces.
    logit_bias: dict[str, Bias] | None = Field(default=None, max_length=MAX_LOGIT_BIAS_TOKENS)
    # llama.cpp's: the LoRA adapter (by id, with a scale) this request runs with; `model`
    # naming the adapter does the same.
    lora: list[LoraChoice] | None = Field(default=None, max_length=64)
    # Accepted with no effect on the answer: bookkeeping for the client's own side (metadata,
    # store, service_tier) and llama.cpp's cache_prompt (the prefix cache is always on).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    cache_prompt: bool | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            guided=self.grammar_spec(),
            logit_bias=self.token_biases(),
            speculative=self.speculative,
        )

    def token_biases(self) -> dict[int, float]:
        biases = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or len(key) > 10:
                raise SamplingParamsError("logit_bias", f"keys are token ids, got {key[:20]!r}")
            biases[int(key)] = value
        return biases

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def grammar_spec(self) -> GrammarSpec | None:
        """Raises GrammarError naming the field."""
        return spec_from_request(self.response_format, self.guided_json, self.guided_regex,
                                 self.guided_choice, self.guided_grammar, grammar=self.grammar,
                                 json_schema=self.json_schema)


class CompletionRequest(SamplingFields):
    # StrictInt: JSON's true/false are not token ids
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    max_tokens: int | None = Field(default=COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # vLLM's: the last message is the assistant's, and the answer continues it (prefill).
    continue_final_message: bool = False
    parallel_tool_calls: bool = True

    def generation_prompt(self) -> bool:
        """Whether the template opens a new assistant turn: not when continuing the last."""
        if not self.continue_final_message:
            return self.add_generation_prompt
        if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise FieldError("continue_final_message", "cannot be combined with "
                             "add_generation_prompt: true (one continues the last message, "
                             "the other starts a new one)")
        return False


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[StrictInt]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def now() -> int:
    return int(time.time())
