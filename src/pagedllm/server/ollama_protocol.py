"""Pydantic schemas of Ollama's /api/chat and /api/generate, and their mapping to
SamplingParams: what an Ollama client sends, read the way Ollama reads it.

Sampling defaults are Ollama's (temperature 0.8, top_k 40, top_p 0.9), except
repeat_penalty: pagedllm's repetition penalty is vLLM's (over the whole context), not
llama.cpp's window of the last 64 tokens, so it is off unless a request asks for it.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from pagedllm.core.request import SamplingParams
from pagedllm.core.residency import KeepAliveError, parse_keep_alive
from pagedllm.server.errors import APIError
from pagedllm.server.request_model import RequestModel
from pagedllm.structured.spec import GrammarSpec, json_schema_spec

DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P = 0.8, 40, 0.9


class OllamaOptions(RequestModel):
    """The `options` pagedllm acts on; Ollama's others (num_gpu, mirostat, ...) are accepted
    and ignored, as Ollama itself ignores options its runner does not know."""

    model_config = ConfigDict(extra="allow")

    num_predict: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_k: int | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | str | None = None
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    num_ctx: int | None = Field(default=None, ge=1)
    # pagedllm's extension, as on the OpenAI routes: speculative decoding for this request.
    speculative: Literal["off", "ngram", "draft"] | None = None


class OllamaFields(RequestModel):
    """Shared by /api/chat and /api/generate."""

    model_config = ConfigDict(extra="allow")

    model: str = ""
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    stream: bool = True
    keep_alive: str | int | float | None = None  # a store's model stays loaded this long
    # A reasoning model's thinking on or off where its template has the switch (Qwen3's);
    # either way it comes back apart, as `thinking`, never inside the answer.
    think: bool | None = None

    def template_options(self, has_switch: bool) -> dict:
        return {"enable_thinking": self.think} if has_switch and self.think is not None else {}

    def grammar(self) -> GrammarSpec | None:
        if not self.format:
            return None
        schema = {"type": "object"} if self.format == "json" else self.format
        return json_schema_spec(schema, "format")

    def sampling_params(self) -> SamplingParams:
        o = self.options
        if o.num_predict is not None and o.num_predict not in (-1, -2) and o.num_predict < 1:
            raise APIError(400, "options.num_predict must be -1 (no limit), -2 (fill the "
                                "context) or at least 1", "options.num_predict")
        return SamplingParams(
            max_tokens=o.num_predict if o.num_predict and o.num_predict > 0 else None,
            temperature=DEFAULT_TEMPERATURE if o.temperature is None else o.temperature,
            top_k=DEFAULT_TOP_K if o.top_k is None else o.top_k,
            top_p=DEFAULT_TOP_P if o.top_p is None else o.top_p,
            min_p=o.min_p or 0.0,
            seed=o.seed,
            stop=[o.stop] if isinstance(o.stop, str) else list(o.stop or []),
            repetition_penalty=1.0 if o.repeat_penalty is None else o.repeat_penalty,
            presence_penalty=o.presence_penalty or 0.0,
            frequency_penalty=o.frequency_penalty or 0.0,
            guided=self.grammar(),
            speculative=o.speculative,
        )


class OllamaToolCallFunction(RequestModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(RequestModel):
    function: OllamaToolCallFunction


class OllamaMessage(RequestModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None


class OllamaChatRequest(OllamaFields):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(OllamaFields):
    prompt: str = ""
    system: str | None = None
    template: str | None = None
    suffix: str | None = None
    raw: bool = False
    context: list[int] | None = None
    images: list[str] | None = None


class OllamaModelRequest(RequestModel):
    model_config = ConfigDict(extra="allow")

    model: str = ""
    name: str = ""  # older clients' spelling of `model`


def keep_alive_seconds(value) -> float | None:
    """Ollama's `keep_alive` in seconds (None: the server's default); a bad value is a 400
    naming the field."""
    if value is None:
        return None
    try:
        return parse_keep_alive(value)
    except KeepAliveError as exc:
        raise APIError(400, str(exc), "keep_alive") from exc
