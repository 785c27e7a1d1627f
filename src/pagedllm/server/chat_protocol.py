"""The chat conversation as OpenAI's API sends it (messages, earlier tool calls and thinking,
the template's own variables), shared by chat completions and llama.cpp's /apply-template,
and its mapping to the shape the chat template is given (tool_calls/prompt.py)."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field

from pagedllm.errors import FieldError
from pagedllm.server.request_model import RequestModel
from pagedllm.tool_calls.spec import ToolError


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


class ChatTemplateFields(RequestModel):
    """What a chat request gives the model's template."""
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    # vLLM's: more variables for the chat template (Qwen3's enable_thinking), each one the
    # template reads (others are refused by name).
    chat_template_kwargs: dict[str, Any] | None = None

    def template_options(self, known: frozenset[str]) -> dict[str, Any]:
        return template_options(self.chat_template_kwargs, known)

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


class ApplyTemplateRequest(ChatTemplateFields):
    """llama.cpp's /apply-template: the prompt a chat request would be, as text."""
    model: str | None = None


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
