"""Pydantic schemas of the OpenAI API subset pagedllm serves, and their mapping to
SamplingParams. Validation errors become 400s that name the field."""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints, field_validator

from pagedllm.config import CHAT_DEFAULT_MAX_TOKENS, COMPLETIONS_DEFAULT_MAX_TOKENS
from pagedllm.core.request import (LOGIT_BIAS_RANGE, MAX_INT32, MAX_LOGIT_BIAS_TOKENS,
                                   MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                   MIN_REPETITION_PENALTY, SEED_RANGE, SamplingParams,
                                   SamplingParamsError)
from pagedllm.errors import FieldError
from pagedllm.structured.spec import GrammarSpec, spec_from_request
from pagedllm.tool_calls.spec import ToolError


def random_id(prefix: str, separator: str = "-") -> str:
    """An id the way the API it belongs to spells them (clients check the prefix): OpenAI's
    chat and completion ids with "-" (chatcmpl-...), the Responses API's and Anthropic's
    with "_" (resp_..., msg_...)."""
    return f"{prefix}{separator}{uuid.uuid4().hex}"


# The bounds SamplingParams holds every request to (core/request.py), published in the schema.
StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]
TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_INT32)]


class RequestModel(BaseModel):
    """Request bodies are read strictly, as the published schema says: 0 is not false, "1"
    is not 1, true is not a token id. A field the model does not declare is refused (a 400
    naming it); a model that takes others says so."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(RequestModel):
    include_usage: bool = False


Bias = Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]


class LoraChoice(RequestModel):
    """llama.cpp's per-request adapter: its id in GET /lora-adapters and its scale."""

    id: int = Field(ge=0)
    scale: float = Field(default=1.0, ge=-10.0, le=10.0, allow_inf_nan=False)


class SamplingFields(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions. Every field is honoured
    or listed as having no effect on the answer (README's field table, held by a test); any
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


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionCall(RequestModel):
    name: str
    arguments: str = "{}"  # a JSON object, as OpenAI sends it


class MessageToolCall(RequestModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    # An earlier answer's thinking (vLLM's and DeepSeek's field): handed to the chat template,
    # which decides what to keep (Qwen3's keeps the turn in progress's).
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    # vLLM's: the last message is the assistant's, and the answer continues it (prefill).
    continue_final_message: bool = False
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # vLLM's: more variables for the chat template (Qwen3's enable_thinking), each one the
    # template reads (others are refused by name).
    chat_template_kwargs: dict[str, Any] | None = None

    def template_options(self, known: frozenset[str]) -> dict[str, Any]:
        return template_options(self.chat_template_kwargs, known)

    def generation_prompt(self) -> bool:
        """Whether the template opens a new assistant turn: not when continuing the last."""
        if not self.continue_final_message:
            return self.add_generation_prompt
        if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise FieldError("continue_final_message", "cannot be combined with "
                             "add_generation_prompt: true (one continues the last message, "
                             "the other starts a new one)")
        return False

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


def template_options(kwargs: dict[str, Any] | None, known: frozenset[str]) -> dict[str, Any]:
    """A request's chat_template_kwargs, each a variable the template reads (known), else
    refused by name."""
    for key in kwargs or {}:
        if key not in known:
            raise FieldError(f"chat_template_kwargs.{key}",
                             f"this model's chat template has no variable {key!r} "
                             f"(it reads: {', '.join(sorted(known)) or 'none'})")
    return dict(kwargs or {})


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation in tool_calls/prompt.py's shape. Raises ToolError for a call whose
    arguments are not a JSON object."""
    out = []
    for i, m in enumerate(messages):
        # "developer" is OpenAI's newer name for "system".
        message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "name": c.function.name,
                 "arguments": call_arguments(c.function.arguments,
                                         f"messages[{i}].tool_calls[{j}].function.arguments")}
                for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            message["reasoning_content"] = m.reasoning_content
        if m.name:
            message["name"] = m.name
        out.append(message)
    return out


def call_arguments(text: str, param: str) -> dict:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as exc:
        raise ToolError(param, f"is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ToolError(param, "nests too deep") from exc
    if not isinstance(value, dict):
        raise ToolError(param, "must be a JSON object")
    return value


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class ApplyTemplateRequest(RequestModel):
    """llama.cpp's /apply-template: the prompt a chat request would be, as text."""
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def template_options(self, known: frozenset[str]) -> dict[str, Any]:
        return template_options(self.chat_template_kwargs, known)

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


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
