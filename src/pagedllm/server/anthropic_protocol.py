"""Pydantic schemas of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens)
and their mapping onto what every chat API shares: the conversation in tool_calls/prompt.py's
shape, OpenAI-style tools and tool_choice (chat_prompt.py reads those), SamplingParams.

Every field is honoured, accepted with no effect on the answer (metadata, cache_control:
the prefix cache is always on), or refused with a 400 naming it."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import Field

from pagedllm.core.request import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from pagedllm.errors import FieldError
from pagedllm.server.request_model import RequestModel
from pagedllm.structured.spec import GrammarSpec, json_schema_spec

StopSequence = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class CacheControl(RequestModel):
    type: Literal["ephemeral"] = "ephemeral"
    ttl: str | None = None


class Block(RequestModel):
    cache_control: CacheControl | None = None  # no effect: every prefix is cached anyway


class TextBlock(Block):
    type: Literal["text"]
    text: str
    citations: list[Any] | None = None  # only null or [] (checked below): none are made


class ToolUseBlock(Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else \
            "".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(Block):
    """An earlier answer's thinking, sent back in the history (Claude Code does)."""
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                               RedactedThinkingBlock], Field(discriminator="type")]


class Message(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def blocks(self) -> list:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Tool(RequestModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (web search, ...) are refused
    cache_control: CacheControl | None = None


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(RequestModel):
    user_id: str | None = None  # who asks (without keys): fair share and metrics use it


class Thinking(RequestModel):
    """Extended thinking. Where the model's chat template has a thinking switch (Qwen3's
    enable_thinking) it is set by this; elsewhere it changes nothing (the model thinks as it
    always does). budget_tokens is checked as Anthropic checks it; the whole answer,
    thinking included, is bounded by max_tokens."""
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)

    def template_options(self, has_switch: bool) -> dict:
        if not has_switch:
            return {}
        return {"enable_thinking": self.type != "disabled"}

    def budget(self) -> int | None:
        """The thinking tokens allowed before the model is made to answer (enabled only)."""
        return self.budget_tokens if self.type == "enabled" else None


class OutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    format: OutputFormat | None = None  # structured output: held by the grammar machinery
    effort: None = None  # these models do not think harder on request: only null is taken


class MessagesFields(RequestModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def system_text(self) -> str | None:
        if self.system is None:
            return None
        return self.system if isinstance(self.system, str) else \
            "\n\n".join(b.text for b in self.system)

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as the chat template reads them: tool results become tool turns,
        an assistant's tool_use blocks its tool_calls."""
        out: list[dict[str, Any]] = []
        system = self.system_text()
        if system:
            out.append({"role": "system", "content": system})
        for i, message in enumerate(self.messages):
            text, calls, thinking = [], [], []
            for j, block in enumerate(message.blocks()):
                where = f"messages[{i}].content[{j}]"
                if isinstance(block, TextBlock):
                    if block.citations:
                        raise FieldError(f"{where}.citations", "citations are not supported")
                    text.append(block.text)
                elif isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
                    # An earlier turn's thinking: handed to the template as the message's
                    # reasoning_content, which decides what to keep (Qwen3's drops past
                    # turns' and keeps the turn in progress's).
                    if message.role != "assistant":
                        raise FieldError(where, f"{block.type} blocks come from the assistant")
                    if isinstance(block, ThinkingBlock):
                        thinking.append(block.thinking)
                elif isinstance(block, ToolUseBlock):
                    if message.role != "assistant":
                        raise FieldError(where, "tool_use blocks come from the assistant")
                    calls.append({"id": block.id, "name": block.name, "arguments": block.input})
                else:
                    if message.role != "user":
                        raise FieldError(where, "tool_result blocks come from the user")
                    out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                "content": block.text()})
            if text or calls or thinking or not out or out[-1]["role"] != "tool":
                turn: dict[str, Any] = {"role": message.role, "content": "".join(text)}
                if calls:
                    turn["tool_calls"] = calls
                if thinking:
                    turn["reasoning_content"] = "".join(thinking)
                out.append(turn)
        return out

    def prefill(self) -> bool:
        """Anthropic's prefill: a final assistant turn is the start of the answer."""
        last = self.messages[-1]
        if last.role != "assistant":
            return False
        if any(isinstance(b, ToolUseBlock) for b in last.blocks()):
            raise FieldError(f"messages[{len(self.messages) - 1}]", "a final assistant turn "
                             "that is continued must hold text only, not tool_use")
        return True

    def openai_tools(self) -> list[dict] | None:
        if self.tools is None:
            return None
        return [{"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in self.tools]

    def openai_tool_choice(self) -> str | dict | None:
        choice = self.tool_choice
        if choice is None:
            return None
        if choice.type == "tool":
            if not choice.name:
                raise FieldError("tool_choice.name", 'is required with type "tool"')
            return {"type": "function", "function": {"name": choice.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]

    def parallel_tool_calls(self) -> bool:
        return not (self.tool_choice and self.tool_choice.disable_parallel_tool_use)


class MessagesRequest(MessagesFields):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[StopSequence] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # No effect on the answer: the prefix cache is always on, there is one tier, one place
    # and one speed here, and no workspaces or profiles.
    cache_control: CacheControl | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def sampling_params(self) -> SamplingParams:
        thinking = self.thinking
        if thinking is not None and thinking.type == "enabled":
            budget = thinking.budget_tokens
            if budget is None:
                raise FieldError("thinking.budget_tokens", "is required when thinking is enabled")
            if budget >= self.max_tokens:
                raise FieldError("thinking.budget_tokens", f"must be less than max_tokens "
                                                           f"({self.max_tokens}), got {budget}")
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=list(self.stop_sequences or []),
            guided=self.grammar_spec())

    def grammar_spec(self) -> GrammarSpec | None:
        fmt = self.output_config.format if self.output_config else None
        return None if fmt is None else json_schema_spec(fmt.schema_,
                                                         "output_config.format.schema")

    def user(self) -> str | None:
        return self.metadata.user_id if self.metadata else None


class CountTokensRequest(MessagesFields):
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None  # what a request would be held to: no tokens
    cache_control: CacheControl | None = None


def tool_input(arguments: str) -> dict:
    """A parsed call's arguments (a JSON object as text) as a tool_use block's input."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
